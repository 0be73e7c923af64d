// diffrl ui: a run page's image cards open on each key's newest step (diffrl/flows/mlflow_ui.py says why).
//
// MLflow 3.17 builds the "Model metrics" tab of a run from the state it keeps in the browser's local storage under
// MLflowLocalStorage-1.1-RunPage-<run id>-model-chartUIState, and a new image card starts at step 0 (the rollout card
// of a diffrl run is empty there: its first rollout is step 1). Where that state is read, this script answers with
// the stored state (or, on a first visit, a state holding only the image cards, which MLflow completes with the
// metric cards as it does for any image or metric it finds missing) whose image cards stand on the newest step the
// run logged. A card the user moved (its step is not the one this script set, `diffrlStep`) is left where it is.
// The run page shows one run: its image cards leave out the run's params, which would push the images down.
(function () {
  var PREFIX = "MLflowLocalStorage-1.1-RunPage-";
  var SUFFIX = "-model-chartUIState";
  var SECTION = "Model metrics"; // MLflow's section for a key without a "/" prefix
  // MLflow draws an image in a square box as wide as the image (1024 px for a grid of 4 samples a row), under the
  // card's title and legend and above its slider: this height shows such a grid whole, without a scroll bar in the card
  var CARD_HEIGHT = 1180;
  var getItem = Storage.prototype.getItem;

  // {image key: newest step}: the run's images/ artifacts are named <key with / as ~>+step+<k>+timestamp+...
  function newestSteps(runId) {
    var request = new XMLHttpRequest();
    // synchronous: MLflow reads the state synchronously while it draws the tab (one local request per visit)
    request.open("GET", "ajax-api/2.0/mlflow/artifacts/list?run_id=" + encodeURIComponent(runId) + "&path=images", false);
    request.send();
    var steps = {};
    if (request.status !== 200) return steps;
    (JSON.parse(request.responseText).files || []).forEach(function (file) {
      var match = /^images\/(.+)\+step\+(\d+)\+timestamp\+/.exec(file.path);
      if (!match) return;
      var key = match[1].replace(/~/g, "/");
      var step = parseInt(match[2], 10);
      if (!(key in steps) || step > steps[key]) steps[key] = step;
    });
    return steps;
  }

  function sectionOf(key) {
    var parts = key.split("/");
    return parts.length > 1 ? parts.slice(0, -1).join("/") : SECTION;
  }

  function newId() {
    return "diffrl-" + Math.random().toString(36).slice(2) + Date.now().toString(36);
  }

  function withNewestSteps(runId, stored) {
    var steps = newestSteps(runId);
    var keys = Object.keys(steps).sort();
    if (!keys.length) return stored;
    var state = stored ? JSON.parse(stored) : {};
    if (!state.compareRunCharts || !state.compareRunSections) {
      state = {
        isAccordionReordered: false,
        compareRunCharts: [],
        compareRunSections: [],
        autoRefreshEnabled: true,
        globalLineChartConfig: { xAxisKey: "step", lineSmoothness: 0, selectedXAxisMetricKey: "" },
      };
    }
    keys.forEach(function (key) {
      var card = state.compareRunCharts.filter(function (c) {
        return c.type === "IMAGE" && c.imageKeys && c.imageKeys.length === 1 && c.imageKeys[0] === key;
      })[0];
      if (card) {
        if (card.diffrlStep !== undefined && card.step === card.diffrlStep) card.step = card.diffrlStep = steps[key];
        return;
      }
      var name = sectionOf(key);
      var section = state.compareRunSections.filter(function (s) { return s.name === name; })[0];
      if (!section) {
        // diffrl's image keys have no prefix and its metrics all have one: this section holds the image cards alone.
        // One card a row, tall enough for a grid at its own size, captions readable (MLflow: 3 a row, 360 px high).
        section = {
          uuid: newId(), name: name, display: true, isReordered: false, deleted: false, isGenerated: true,
          columns: 1, cardHeight: CARD_HEIGHT,
        };
        state.compareRunSections.push(section);
      }
      state.compareRunCharts.push({
        uuid: newId(), type: "IMAGE", runsCountToCompare: 10, metricSectionId: section.uuid, deleted: false,
        isGenerated: true, imageKeys: [key], step: steps[key], diffrlStep: steps[key], showRunParams: false,
      });
    });
    return JSON.stringify(state);
  }

  Storage.prototype.getItem = function (name) {
    var stored = getItem.call(this, name);
    if (typeof name !== "string" || name.indexOf(PREFIX) !== 0 || name.slice(-SUFFIX.length) !== SUFFIX) return stored;
    try {
      return withNewestSteps(name.slice(PREFIX.length, -SUFFIX.length), stored);
    } catch (e) {
      return stored; // MLflow's own behaviour (cards from step 0) rather than a broken page
    }
  };
})();
