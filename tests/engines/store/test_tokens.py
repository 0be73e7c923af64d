"""The token store (diffrl.engines.store.tokens) with a table written before token rows had an audios column: its
rows read back (no clips), and it takes no rows of the new layout."""

from __future__ import annotations

import lance
import pytest
import torch

from diffrl.engines.numbering import step_number
from diffrl.engines.store.tokens import TokenStore, token_rows
from diffrl.engines.token_trajectories import TokenTrajectories


def _traj(group: str) -> TokenTrajectories:
    return TokenTrajectories(
        prompts=["hi", "hi"],
        group_ids=[group, group],
        sample_index=torch.tensor([0, 1]),
        seeds=torch.tensor([1, 2]),
        image_paths=[(), ()],
        prompt_ids=[torch.tensor([5, 6]), torch.tensor([5, 6])],
        response_ids=[torch.tensor([7]), torch.tensor([8, 9])],
        log_probs=[torch.tensor([-0.5]), torch.tensor([-1.0, -2.0])],
        responses=["a", "b c"],
    )


def test_a_table_without_the_audios_column_reads_and_refuses_new_rows(tmp_path):
    uri = str(tmp_path / "trajectories.lance")
    old = token_rows(_traj("g0"), run="r", step=step_number(1), chunk=0, write_id="w0")
    old = old.drop_columns(["audios"]).replace_schema_metadata(old.schema.metadata)
    lance.write_dataset(old, uri)
    store = TokenStore(uri)
    back = store.read_chunk(1, 0)
    assert back.responses == ["a", "b c"] and back.audio_paths == [(), ()]
    with pytest.raises(ValueError, match="written before token rows had an audios column.*new run.name"):
        store.append(_traj("g1"), run="r", step=2, chunk=0)
