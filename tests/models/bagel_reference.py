"""An independent, straightforward reading of BAGEL's reference text-to-image sampler, for the parity test.

Written from github.com/ByteDance-Seed/Bagel, following its control flow rather than diffrl's: `InterleaveInferencer.
interleave_inference` for one text prompt (gen context <- the prompt, the text-CFG context stays empty), then
`Bagel.prepare_prompts` + `forward_cache_update_text` (the prompt's keys/values cached layer by layer through the
understanding expert, causal), `prepare_vae_latent` (<|vision_start|>, h*w noise tokens, <|vision_end|>, all at the
RoPE position after the text), `generate_image` (linspace(1, 0, num_timesteps) shifted, Euler x <- x - v dt, CFG only
inside cfg_interval) and `_forward_flow` (per-token expert routing by index lists, the query attends to the cache
plus itself without a causal mask, CFG-renorm "global"), then `decode_image`. Tensors are read straight out of
ema.safetensors by name, every layer is plain tensor algebra (explicit softmax attention, repeat-kv), one image at a
time as the reference runs. Nothing of diffrl.models.bagel is imported except to decode through the same VAE.
"""

from __future__ import annotations

import math

import torch
from safetensors.torch import load_file


class ReferenceBagel:
    """The reference sampler on the weights of a BAGEL folder (fp32, CPU)."""

    def __init__(self, folder: str, llm_config: dict, token_ids: dict[str, int], tokenizer):
        self.w = {k: v.double() for k, v in load_file(f"{folder}/ema.safetensors").items()}
        self.cfg = llm_config
        self.ids = token_ids
        self.tokenizer = tokenizer
        self.heads = llm_config["num_attention_heads"]
        self.kv_heads = llm_config["num_key_value_heads"]
        self.head_dim = llm_config["hidden_size"] // self.heads
        self.eps = llm_config["rms_norm_eps"]
        self.side = int(math.isqrt(self.w["latent_pos_embed.pos_embed"].shape[0]))

    # ---- building blocks --------------------------------------------------------------------------------------
    def _rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _linear(self, x, name, bias=True):
        out = x @ self.w[f"{name}.weight"].T
        return out + self.w[f"{name}.bias"] if bias and f"{name}.bias" in self.w else out

    def _rope(self, x_NHD, pos_N):
        inv = 1.0 / (self.cfg["rope_theta"] ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        ang = pos_N.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        half = self.head_dim // 2
        rotated = torch.cat([-x_NHD[..., half:], x_NHD[..., :half]], -1)
        return x_NHD * cos + rotated * sin

    def _mlp(self, x, prefix):
        gate, up = self._linear(x, f"{prefix}.gate_proj"), self._linear(x, f"{prefix}.up_proj")
        return self._linear(torch.nn.functional.silu(gate) * up, f"{prefix}.down_proj")

    def _attend(self, q_NHD, k_MHD, v_MHD, causal: bool):
        rep = self.heads // self.kv_heads
        k, v = k_MHD.repeat_interleave(rep, dim=1), v_MHD.repeat_interleave(rep, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q_NHD, k) / math.sqrt(self.head_dim)
        if causal:
            n, m = scores.shape[1:]
            scores = scores.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
        return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v).reshape(q_NHD.shape[0], -1)

    # ---- forward_cache_update_text: the prompt through the understanding expert, keys/values cached -----------
    def text_cache(self, prompt: str | None):
        """Per layer (K, V) of the context, and the next RoPE position; None prompt = the empty CFG context."""
        layers = self.cfg["num_hidden_layers"]
        if prompt is None:
            return [None] * layers, 0
        ids = [self.ids["bos_token_id"], *self.tokenizer.encode(prompt), self.ids["eos_token_id"]]
        h = self.w["language_model.model.embed_tokens.weight"][torch.tensor(ids)]
        pos = torch.arange(len(ids))
        cache = []
        for i in range(layers):
            p = f"language_model.model.layers.{i}"
            x = self._rms(h, f"{p}.input_layernorm.weight")
            q = self._linear(x, f"{p}.self_attn.q_proj").view(len(ids), self.heads, self.head_dim)
            k = self._linear(x, f"{p}.self_attn.k_proj").view(len(ids), self.kv_heads, self.head_dim)
            v = self._linear(x, f"{p}.self_attn.v_proj").view(len(ids), self.kv_heads, self.head_dim)
            q = self._rope(self._rms(q, f"{p}.self_attn.q_norm.weight"), pos)
            k = self._rope(self._rms(k, f"{p}.self_attn.k_norm.weight"), pos)
            cache.append((k, v))
            h = h + self._linear(self._attend(q, k, v, causal=True), f"{p}.self_attn.o_proj", bias=False)
            h = h + self._mlp(self._rms(h, f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
        return cache, len(ids)

    # ---- _forward_flow: one velocity of the query [soi, latents, eoi] against a cache ------------------------
    def forward_flow(self, x_LP, t: float, cache, rope_pos: int, rows: int, cols: int):
        n = x_LP.shape[0] + 2
        text_idx = torch.tensor([0, n - 1])  # packed_text_indexes: the two markers
        vae_idx = torch.arange(1, n - 1)  # packed_vae_token_indexes
        seq = torch.zeros(n, self.cfg["hidden_size"], dtype=torch.float64)
        seq[text_idx] = self.w["language_model.model.embed_tokens.weight"][
            torch.tensor([self.ids["start_of_image"], self.ids["end_of_image"]])
        ]
        pos_ids = (torch.arange(rows)[:, None] * self.side + torch.arange(cols)).flatten()
        seq[vae_idx] = (
            self._linear(x_LP, "vae2llm") + self._time_embed(t) + self.w["latent_pos_embed.pos_embed"][pos_ids]
        )
        pos = torch.full((n,), rope_pos)
        for i, past in enumerate(cache):
            p = f"language_model.model.layers.{i}"
            residual = seq
            x = torch.zeros_like(seq)
            x[text_idx] = self._rms(seq[text_idx], f"{p}.input_layernorm.weight")
            x[vae_idx] = self._rms(seq[vae_idx], f"{p}.input_layernorm_moe_gen.weight")
            qkv = {}
            for name, heads in (("q", self.heads), ("k", self.kv_heads), ("v", self.kv_heads)):
                out = torch.zeros(n, heads * self.head_dim, dtype=torch.float64)
                out[text_idx] = self._linear(x[text_idx], f"{p}.self_attn.{name}_proj")
                out[vae_idx] = self._linear(x[vae_idx], f"{p}.self_attn.{name}_proj_moe_gen")
                qkv[name] = out.view(n, heads, self.head_dim)
            for name in ("q", "k"):
                normed = torch.zeros_like(qkv[name])
                normed[text_idx] = self._rms(qkv[name][text_idx], f"{p}.self_attn.{name}_norm.weight")
                normed[vae_idx] = self._rms(qkv[name][vae_idx], f"{p}.self_attn.{name}_norm_moe_gen.weight")
                qkv[name] = self._rope(normed, pos)
            k, v = qkv["k"], qkv["v"]
            if past is not None:
                k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
            attn = self._attend(qkv["q"], k, v, causal=False)
            out = torch.zeros_like(seq)
            out[text_idx] = self._linear(attn[text_idx], f"{p}.self_attn.o_proj", bias=False)
            out[vae_idx] = self._linear(attn[vae_idx], f"{p}.self_attn.o_proj_moe_gen", bias=False)
            seq = residual + out
            residual = seq
            out = torch.zeros_like(seq)
            out[text_idx] = self._mlp(self._rms(seq[text_idx], f"{p}.post_attention_layernorm.weight"), f"{p}.mlp")
            out[vae_idx] = self._mlp(
                self._rms(seq[vae_idx], f"{p}.post_attention_layernorm_moe_gen.weight"), f"{p}.mlp_moe_gen"
            )
            seq = residual + out
        final = self._rms(seq[vae_idx], "language_model.model.norm_moe_gen.weight")
        return self._linear(final, "llm2vae")

    def _time_embed(self, t: float):
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
        args = t * freqs
        h = self._linear(torch.cat([torch.cos(args), torch.sin(args)]), "time_embedder.mlp.0")
        return self._linear(torch.nn.functional.silu(h), "time_embedder.mlp.2")

    # ---- generate_image ----------------------------------------------------------------------------------------
    def generate(self, prompt: str, noise_LP, rows, cols, *, num_timesteps, cfg_text_scale, interval, shift=3.0):
        """Every latent x_0 .. x_N (N + 1, L, P) of generate_image with cfg_renorm_type "global", cfg_renorm_min 0
        (the reference returns the last)."""
        cache, rope = self.text_cache(prompt)
        cfg_cache, cfg_rope = self.text_cache(None)
        t = torch.linspace(1, 0, num_timesteps, dtype=torch.float64)
        t = shift * t / (1 + (shift - 1) * t)
        dts = t[:-1] - t[1:]
        x = noise_LP.double()
        xs = [x]
        for i, ti in enumerate(t[:-1].tolist()):
            v = self.forward_flow(x, ti, cache, rope, rows, cols)
            scale = cfg_text_scale if interval[0] < ti <= interval[1] else 1.0
            if scale > 1.0:
                v_text = self.forward_flow(x, ti, cfg_cache, cfg_rope, rows, cols)
                guided = v_text + scale * (v - v_text)
                v = guided * (torch.norm(v) / (torch.norm(guided) + 1e-8)).clamp(min=0.0, max=1.0)
            x = x - v * dts[i]
            xs.append(x)
        return torch.stack(xs)
