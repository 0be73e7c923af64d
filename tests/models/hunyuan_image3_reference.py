"""An independent, straightforward reading of HunyuanImage-3.0's reference text-to-image sampler, for the parity test.

Written from github.com/Tencent-Hunyuan/HunyuanImage-3.0 (`hunyuan_image_3/hunyuan.py`, `hunyuan_image_3_pipeline.py`,
`tokenizer_wrapper.py`), following its control flow rather than diffrl's: `prepare_model_inputs(mode="gen_image")`
with the "pretrain" template (`encode_sequence`: <bos> text <boi> <img_size> <img_ratio> <timestep> <img>*L <eoi>,
and the <cfg> copy of the text for the unconditional row), `build_2d_rope` (float meshgrid from
beta = L + (hw - h) / 2, truncated with `.long()`), `_prepare_attention_mask_for_generation` (tril, then True inside
the image slice), then the pipeline's loop: the first step runs the whole sequence and fills the KV cache; every later
step runs only `<timestep>` + the image tokens (`forward` with first_step False) against the cached prefix; `topkgating`
with its dense one-hot dispatch / combine tensors; the Euler step of `FlowMatchDiscreteScheduler` and
`ClassifierFreeGuidance`. Tensors are read straight out of the safetensors shards by name, everything is fp64 tensor
algebra (explicit softmax attention, GroupNorm / conv through torch.nn.functional), one image at a time. Nothing of
diffrl.models.hunyuan_image3 is imported except to decode through the same VAE.
"""

from __future__ import annotations

import glob
import math

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class ReferenceHunyuanImage3:
    """The reference sampler on the weights of a HunyuanImage-3.0 folder (fp64, CPU)."""

    def __init__(self, folder: str, config: dict, tokenizer, token_ids: dict[str, int]):
        self.w = {}
        for path in sorted(glob.glob(f"{folder}/*.safetensors")):
            self.w.update({k: v.double() for k, v in load_file(path).items()})
        self.cfg, self.tokenizer, self.ids = config, tokenizer, token_ids
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim, self.eps = config["attention_head_dim"], config["rms_norm_eps"]

    # ---- building blocks --------------------------------------------------------------------------------------
    def _rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _linear(self, x, name):
        out = x @ self.w[f"{name}.weight"].T
        return out + self.w[f"{name}.bias"] if f"{name}.bias" in self.w else out

    def _swiglu(self, x, name):
        x1, x2 = self._linear(x, f"{name}.gate_and_up_proj").chunk(2, dim=-1)
        return self._linear(x1 * F.silu(x2), f"{name}.down_proj")

    def _moe(self, x, p, layer):
        """topkgating (drop_tokens False) + the einsum dispatch / combine of HunyuanMoE, plus the shared MLP."""
        topk = self.cfg["moe_topk"][layer] if isinstance(self.cfg["moe_topk"], list) else self.cfg["moe_topk"]
        gates = (x @ self.w[f"{p}.mlp.gate.wg.weight"].T).softmax(dim=1)
        num_experts = gates.shape[1]
        _, index = torch.topk(gates, topk)
        chosen = F.one_hot(index, num_experts).double()  # (N, K, E)
        denominator = (chosen @ gates.unsqueeze(-1)).sum(dim=1).clamp(min=torch.finfo(torch.float64).eps)
        combine = (gates / denominator) * chosen.sum(dim=1)  # router_probs on the chosen experts, 0 elsewhere
        out = sum(combine[:, e : e + 1] * self._swiglu(x, f"{p}.mlp.experts.{e}") for e in range(num_experts))
        return out + self._swiglu(x, f"{p}.mlp.shared_mlp")

    def _rope(self, y, x):
        """build_2d_rope: cos, sin (S, Dh) of integer positions y, x (S,)."""
        n = self.head_dim
        theta = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, n, 2, dtype=torch.float64) / n))
        pos = torch.stack([y, x], dim=1).double().unsqueeze(1)  # (S, 1, 2)
        angles = (pos * theta.reshape(1, n // 4, 2)).reshape(-1, n // 2).repeat(1, 2)
        return angles.cos(), angles.sin()

    def _attention(self, h, p, cos, sin, mask, cache, layer):
        """One layer's self-attention of the rows h (Q, D); cache[layer] holds the prefix's (K, V) to prepend."""
        groups = self.heads // self.kv_heads
        qkv = self._linear(h, f"{p}.self_attn.qkv_proj").reshape(h.shape[0], self.kv_heads, groups + 2, -1)
        q, k, v = qkv[:, :, :groups].reshape(h.shape[0], self.heads, -1), qkv[:, :, groups], qkv[:, :, groups + 1]
        half = self.head_dim // 2

        def rotate(t):
            return t * cos[:, None] + torch.cat([-t[..., half:], t[..., :half]], -1) * sin[:, None]

        q = self._rms(rotate(q), f"{p}.self_attn.query_layernorm.weight")
        k = self._rms(rotate(k), f"{p}.self_attn.key_layernorm.weight")
        if layer in cache:
            k, v = torch.cat([cache[layer][0], k]), torch.cat([cache[layer][1], v])
        else:
            cache[layer] = (k, v)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        return self._linear(torch.einsum("hqk,khd->qhd", attn, v).reshape(h.shape[0], -1), f"{p}.self_attn.o_proj")

    def _layers(self, h, cos, sin, mask, cache):
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}"
            h = h + self._attention(self._rms(h, f"{p}.input_layernorm.weight"), p, cos, sin, mask, cache, i)
            h = h + self._moe(self._rms(h, f"{p}.post_attention_layernorm.weight"), p, i)
        return h

    # ---- the image head ---------------------------------------------------------------------------------------
    def _timestep(self, t: float, name: str):
        freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float64) / 128)
        emb = torch.cat([torch.cos(t * freqs), torch.sin(t * freqs)])
        return self._linear(F.gelu(self._linear(emb, f"{name}.mlp.0")), f"{name}.mlp.2")

    def _group_norm(self, x, name):
        return F.group_norm(x, 32, self.w[f"{name}.weight"], self.w[f"{name}.bias"], eps=1e-5)

    def _conv(self, x, name, padding=1):
        return F.conv2d(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], padding=padding)

    def _resblock(self, x, emb, p):
        h = self._conv(F.silu(self._group_norm(x, f"{p}.in_layers.0")), f"{p}.in_layers.2")
        scale, shift = self._linear(F.silu(emb), f"{p}.emb_layers.1")[:, None, None].chunk(2, dim=0)
        h = self._group_norm(h, f"{p}.out_layers.0") * (1 + scale) + shift
        h = self._conv(F.silu(h), f"{p}.out_layers.3")
        skip = self._conv(x, f"{p}.skip_connection", padding=0) if f"{p}.skip_connection.weight" in self.w else x
        return skip + h

    def _patch_embed(self, x_CHW, t):
        h = self._conv(x_CHW[None], "patch_embed.model.0")
        h = self._resblock(h, self._timestep(t, "time_embed"), "patch_embed.model.1")
        return h[0].flatten(1).T  # (L, D), row-major

    def _final_layer(self, h_LD, t, rows, cols):
        x = h_LD.T.reshape(1, -1, rows, cols)
        x = self._resblock(x, self._timestep(t, "time_embed_2"), "final_layer.model.0")
        return self._conv(F.silu(self._group_norm(x, "final_layer.model.1.0")), "final_layer.model.1.2")[0]

    # ---- prepare_model_inputs + the pipeline loop -------------------------------------------------------------
    def _sequence(self, prompt: str, uncond: bool, rows: int, cols: int, ratio_index: int):
        text = self.tokenizer.encode(prompt, add_special_tokens=False)
        if uncond:
            text = [self.ids["cfg"]] * len(text)
        head = [self.ids["bos"], *text, self.ids["boi"], self.ids["size"], self.ids["ratio_offset"] + ratio_index]
        return head + [self.ids["timestep"]] + [self.ids["img"]] * (rows * cols) + [self.ids["eoi"]]

    def _positions(self, seq_len: int, start: int, rows: int, cols: int):
        beta_y, beta_x = start + (rows * cols - rows) / 2, start + (rows * cols - cols) / 2
        ys = torch.linspace(beta_y, beta_y + rows, rows + 1, dtype=torch.float32)[:rows]
        xs = torch.linspace(beta_x, beta_x + cols, cols + 1, dtype=torch.float32)[:cols]
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        after = torch.arange(start + rows * cols, seq_len)
        y = torch.cat([torch.arange(start), grid_y.reshape(-1).long(), after])
        x = torch.cat([torch.arange(start), grid_x.reshape(-1).long(), after])
        return y[:seq_len], x[:seq_len]

    def _velocity_one(self, ids, x_CHW, t, state, rows, cols):
        """One forward of one row; `state` keeps the KV cache of the prefix across steps (first step: None)."""
        start, count = len(ids) - rows * cols - 1, rows * cols
        y, x = self._positions(len(ids), start, rows, cols)
        cos, sin = self._rope(y, x)
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
        mask[start : start + count, start : start + count] = True
        if state.get("cache") is None:  # first step: the whole sequence
            state["cache"] = {}
            h = self.w["model.wte.weight"][torch.tensor(ids)].clone()
            h[start - 1] = self._timestep(t, "timestep_emb")
            h[start : start + count] = self._patch_embed(x_CHW, t)
            full = {}
            h = self._layers(h, cos, sin, mask, full)
            state["cache"] = {i: (k[: start - 1], v[: start - 1]) for i, (k, v) in full.items()}
            out = h[start : start + count]
        else:  # later steps: <timestep> + the image tokens against the cached prefix
            h = torch.cat([self._timestep(t, "timestep_emb")[None], self._patch_embed(x_CHW, t)])
            rows_ = slice(start - 1, start + count)
            cache = dict(state["cache"])
            h = self._layers(h, cos[rows_], sin[rows_], mask[rows_, : start + count], cache)
            out = h[1:]
        return self._final_layer(out, t, rows, cols)

    def generate(self, prompt, noise_CHW, *, steps, guidance_scale, ratio_index, shift=3.0):
        """Every latent x_0 .. x_N (N + 1, C, h, w) of the pipeline (the reference returns the decoded last)."""
        rows, cols = noise_CHW.shape[1:]
        sigmas = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        cond = self._sequence(prompt, False, rows, cols, ratio_index)
        uncond = self._sequence(prompt, True, rows, cols, ratio_index)
        states = ({}, {})
        x = noise_CHW.double()
        xs = [x]
        for i in range(steps):
            t = float(sigmas[i]) * 1000
            v_cond = self._velocity_one(cond, x, t, states[0], rows, cols)
            v = v_cond
            if guidance_scale > 1.0:
                v_uncond = self._velocity_one(uncond, x, t, states[1], rows, cols)
                v = v_uncond + guidance_scale * (v_cond - v_uncond)
            x = x + v * (sigmas[i + 1] - sigmas[i])
            xs.append(x)
        return torch.stack(xs)
