"""Code predictor (MTP): a small dense decoder that fills the residual codebooks 1..G-1 of one frame.

Per frame and row: prefill [talker final hidden, embed(code0)] -> code 1 (lm_head[0]); then feeding
codec_embedding[g-1](code g) -> code g+1 (lm_head[g]). Every row of a batch is at the same step, so the
KV cache is a tiny contiguous ``[B, G+1, kv_heads, head_dim]`` per layer, built fresh for each frame.

On CUDA with the fast path on (``KernelSwitch``: ``use_kernels`` and ``use_fused_steps``), each step runs
through fused kernels instead of the decoder modules (``predict_with_kernels``): per layer norm+qkv, attention
(``kernels.frame_attention``), o_proj+residual, norm+gate/up+SiLU, down+residual (``kernels.small_linear``),
then norm+lm_head: ~28 launches a step (with sampling and the embedding) instead of ~65; ``linear_launch``
picks how those linears launch (one-pass, split-K, or the multiply-add GEMV for few rows). The modules stay
the reference (and the CPU path); the kernels round where they round, except where the served launch runs qkv and
gate/up on cuBLAS (from ``CUBLAS_MIN_ROWS`` rows): there the two pre-norms are folded into those weights
(``folded_weights``) and each row's rstd is applied after the product, by the frame attention and by the
activation: 6 launches a layer instead of 8, as close to the fp32 frame as the bf16 modules (docs/fused_steps.md).
There, at 16-64 rows, qkv and gate/up (+ row scale + SiLU) run on a TMA kernel inside the dependent-launch chain
(``kernels.wide_linear``: 5 launches a layer). At every row count the steps after a frame's first read the first
layer's q/k/v of the fed code from a table made once (``first_layer_qkv_tables``): no qkv GEMM there.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_triton.models.config import TextModelConfig
from omni_triton.models.layers.decoder import DecoderStack
from omni_triton.models.layers.fast_kernels import KernelSwitch

# sample_fn(logits [B, vocab] float32, group) -> codes [B]; ``group`` is the codebook being picked (1..G-1)
SampleFn = Callable[[torch.Tensor, int], torch.Tensor]


FRAME_POSITIONS = 16  # kernels.frame_attention.MAX_POSITIONS: the fused step's cache holds one frame


def greedy(logits: torch.Tensor, group: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


class FrameCache:
    """KV cache of one frame for B rows that all advance together (duck-types ``AttentionBatch.attend``).

    Stored head-major (``[layers, B, kv_heads, len, head_dim]``) so attention reads it in place, with the
    query-head groups handled by SDPA (no repeated K/V): a handful of launches per layer, which is what one
    frame's 15 steps inside a CUDA graph are made of."""

    def __init__(self, num_layers: int, rows: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, rows, num_kv_heads, max_len, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.rows = rows
        self.length = 0  # tokens already cached per row before the current step

    def kv_store(self, layer_idx: int) -> None:
        """No kernel writes this cache's K/V (see ``AttentionBatch.kv_store``)."""
        return None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        rows, new = self.rows, q.shape[0] // self.rows
        end = self.length + new
        self.keys[layer_idx, :, :, self.length:end] = k.view(rows, new, *k.shape[1:]).transpose(1, 2)
        self.values[layer_idx, :, :, self.length:end] = v.view(rows, new, *v.shape[1:]).transpose(1, 2)
        queries = q.view(rows, new, *q.shape[1:]).transpose(1, 2)  # [B, Hq, new, D]
        mask = None
        if new > 1:  # query j sits at position length + j
            q_pos = torch.arange(self.length, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(queries, self.keys[layer_idx, :, :, :end],
                                             self.values[layer_idx, :, :, :end], attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(q.shape)

    def advance(self, new: int) -> None:
        self.length += new


class CodePredictorModel(DecoderStack):
    def __init__(self, cfg: TextModelConfig, num_code_groups: int):
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(num_code_groups - 1))


class CodePredictor(KernelSwitch, nn.Module):
    # the served launch folds the qkv and gate/up pre-norms into their weights where those GEMMs run on cuBLAS
    # (``folded_weights``); off: a norm launch before each, as before (benchmarks compare the two)
    fold_norms: bool = True
    # every step after the first feeds one codebook entry's embedding, so the first layer's q/k/v of every entry
    # are made once (``first_layer_qkv_tables``) and the attention reads the sampled code's row: no qkv GEMM in 14
    # of the 15 steps; off: the GEMM, as before (benchmarks compare the two)
    qkv_tables: bool = True
    # where the pre-norms are folded, qkv and gate/up (+ SiLU) run on the TMA kernel inside the dependent-launch
    # chain at the row counts where it won (``kernels.wide_linear.takes_tma``); off: cuBLAS and the activation
    # kernel, as before
    tma_linears: bool = True

    def __init__(self, cfg: TextModelConfig, num_code_groups: int):
        super().__init__()
        if cfg.mrope_section is not None:
            raise ValueError("code predictor uses plain 1-D RoPE; got an mrope_section")
        self.config = cfg
        self.num_code_groups = num_code_groups
        self.model = CodePredictorModel(cfg, num_code_groups)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(num_code_groups - 1))

    @torch.no_grad()
    def predict(self, talker_hidden: torch.Tensor, code0_embeds: torch.Tensor,
                sample_fn: SampleFn = greedy) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """talker_hidden, code0_embeds [B, H] -> (residual codes [B, G-1], their embeddings G-1 x [B, H])."""
        if self.kernels_for(talker_hidden) and self.use_fused_steps and self.fusable():
            return self.predict_with_kernels(talker_hidden, code0_embeds, sample_fn)
        rows, hidden_size = talker_hidden.shape
        cfg = self.config
        cache = FrameCache(cfg.num_layers, rows, self.num_code_groups + 1, cfg.num_kv_heads, cfg.head_dim,
                           talker_hidden.dtype, talker_hidden.device)
        x = torch.stack((talker_hidden, code0_embeds), dim=1).reshape(rows * 2, hidden_size)
        positions = torch.arange(2, device=x.device).repeat(rows)
        codes, embeds = [], []
        for group in range(1, self.num_code_groups):
            hidden, _ = self.model(x, positions, cache)
            cache.advance(x.shape[0] // rows)
            last = hidden.view(rows, -1, hidden_size)[:, -1]
            code = sample_fn(self.lm_head[group - 1](last).float(), group)
            codes.append(code)
            x = self.model.codec_embedding[group - 1](code)
            embeds.append(x)
            positions = torch.full((rows,), cache.length, dtype=torch.long, device=x.device)
        return torch.stack(codes, dim=1), embeds

    def fusable(self) -> bool:
        """What the fused step assumes of the config (the released one has all of it)."""
        cfg = self.config
        if "_fp8" not in self.__dict__:  # FP8 layers (layers.fp8) run their own kernels through the modules
            self._fp8 = any(p.dtype == torch.float8_e4m3fn for p in self.model.parameters())
        return (not self._fp8 and not cfg.attention_bias and not cfg.num_experts and cfg.hidden_act == "silu"
                and cfg.num_heads % cfg.num_kv_heads == 0
                and cfg.head_dim & (cfg.head_dim - 1) == 0 and self.num_code_groups <= FRAME_POSITIONS)

    @torch.no_grad()
    def predict_with_kernels(self, talker_hidden: torch.Tensor, code0_embeds: torch.Tensor,
                             sample_fn: SampleFn = greedy) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``predict`` through the fused kernels (any device Triton runs on: the interpreter on CPU in tests)."""
        from omni_triton.kernels.frame_attention import frame_attention
        from omni_triton.kernels.small_linear import small_linear, takes_cublas
        from omni_triton.kernels.wide_linear import takes_tma, wide_linear

        cfg, model = self.config, self.model
        # split_k None: small_linear's split plan, 1: the one-pass kernel; gemv: multiply-adds for few rows and
        # cuBLAS for many rows of the wide outputs
        served = self.linear_launch == "gemv"
        launch = dict(split_k=1 if self.linear_launch == "one-pass" else None, gemv=served, cublas=served)
        qkv_cols = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        for layer in model.layers:
            layer.self_attn.pack_projections_()
            layer.mlp.pack_projections_()
        rows, hidden_size = talker_hidden.shape
        positions = self.num_code_groups  # position 0: talker hidden, 1..G-1: code embeddings 0..G-2
        cos, sin = self._rope_table(positions, talker_hidden)
        cache_shape = (cfg.num_layers, rows, cfg.num_kv_heads, positions, cfg.head_dim)
        keys = torch.empty(cache_shape, dtype=talker_hidden.dtype, device=talker_hidden.device)
        values = torch.empty_like(keys)
        x = torch.stack((talker_hidden, code0_embeds), dim=1).reshape(rows * 2, hidden_size)
        start, new = 0, 2
        codes, embeds = [], []
        tables = code = None
        for group in range(1, self.num_code_groups):
            folded = self.folded_weights() if served and self.fold_norms and takes_cublas(x.shape[0], qkv_cols,
                                                                                          False) else None
            tma = self.tma_linears and takes_tma(x.shape[0])
            if group == 2 and self.qkv_tables:
                tables = self.first_layer_qkv_tables()
            for i, layer in enumerate(model.layers):
                attn, mlp = layer.self_attn, layer.mlp
                norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
                attention = dict(q_norm_weight=attn.q_norm.weight, k_norm_weight=attn.k_norm.weight, cos=cos, sin=sin,
                                 keys=keys[i], values=values[i], start=start, new=new, num_heads=cfg.num_heads,
                                 eps=attn.q_norm.eps, scale=attn.head_dim ** -0.5)
                if i == 0 and tables is not None:  # the fed code's row: normed and projected once for every entry
                    attended = frame_attention(tables[group - 2], qkv_rows=code, **attention)
                elif folded is None:
                    qkv = small_linear(x, attn.packed_qkv[0], norm_weight=norm1.weight, eps=norm1.eps, **launch)
                    attended = frame_attention(qkv, **attention)
                else:  # folded pre-norm: the product of the raw residual stream, the attention applies each row's rstd
                    qkv = wide_linear(x, folded[i][0], tma=tma)
                    attended = frame_attention(qkv, input_norm=(x, norm1.eps), **attention)
                if folded is None:
                    x = small_linear(attended, attn.o_proj.weight, residual=x, **launch)
                    gate_up = small_linear(x, mlp.packed_gate_up[0], norm_weight=norm2.weight, eps=norm2.eps,
                                           gated=True, **launch)
                    x = small_linear(gate_up, mlp.down_proj.weight, residual=x, **launch)
                    continue
                # folded: gate/up's epilogue applies the rstd of the o projection's row squares, then the SiLU (5
                # launches a layer, not 8)
                x, squares = small_linear(attended, attn.o_proj.weight, residual=x, row_squares=True, **launch)
                activated = wide_linear(x, folded[i][1], gated=True, input_norm=(squares, hidden_size, norm2.eps),
                                        tma=tma)
                x = small_linear(activated, mlp.down_proj.weight, residual=x, **launch)
            last = x.view(rows, new, hidden_size)[:, -1]
            # logits in the model dtype (the kernels round them to it anyway): the samplers read them as fp32
            # themselves, so no cast launch per step
            logits = small_linear(last, self.lm_head[group - 1].weight, norm_weight=model.norm.weight,
                                  eps=model.norm.eps, **launch)
            code = sample_fn(logits, group)
            codes.append(code)
            x = model.codec_embedding[group - 1](code)
            embeds.append(x)
            start, new = start + new, 1
        return torch.stack(codes, dim=1), embeds

    def folded_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the packed qkv and gate/up weights with their pre-norm's weight folded in (``W * w`` over
        the input features, rounded once to the weights' dtype): RMSNorm(x) @ W.T == rsqrt(mean(x^2) + eps) *
        (x @ (W * w).T), so the norm needs no launch of its own before a cuBLAS GEMM. ~20 MB a layer at full
        size (``derived_from``)."""
        sources = [(layer.self_attn.packed_qkv[0], layer.input_layernorm.weight, layer.mlp.packed_gate_up[0],
                    layer.post_attention_layernorm.weight) for layer in self.model.layers]
        return self.derived_from(
            "folded weights", [t for source in sources for t in source],
            lambda: [tuple((weight.float() * norm.float()[None, :]).to(weight.dtype)
                           for weight, norm in ((qkv, qkv_norm), (gate_up, gate_up_norm)))
                     for qkv, qkv_norm, gate_up, gate_up_norm in sources])

    def first_layer_qkv_tables(self) -> list[torch.Tensor]:
        """For each codebook whose code a later step feeds (``codec_embedding[0 .. G-3]``), the first layer's
        q/k/v of every entry: ``RMSNorm(E) @ W_qkv.T`` [vocab, (Hq + 2 Hkv) * D], rounded as the modules round
        (the normed row, then the product). A step's qkv GEMM becomes a row read by the attention: what the GEMM
        would compute for the fed embedding, made once. 14 x 2048 x 4096 bf16 = 235 MB at full size
        (``derived_from``)."""
        first = self.model.layers[0]
        first.self_attn.pack_projections_()
        norm, qkv_weight = first.input_layernorm, first.self_attn.packed_qkv[0]
        embeddings = [embedding.weight for embedding in self.model.codec_embedding[:self.num_code_groups - 2]]
        return self.derived_from("qkv tables", [qkv_weight, norm.weight, *embeddings],
                                 lambda: [F.linear(norm(embedding), qkv_weight) for embedding in embeddings])

    def derived_from(self, what: str, sources: list[torch.Tensor], make: Callable[[], list]) -> list:
        """``make()``'s tensors (``what``: the folded weights, the qkv tables), made on first use and again whenever
        a source tensor changes (its version counter or storage); refused inside a CUDA graph capture, where they
        could not be made."""
        # inference tensors (packed under inference mode) keep no version counter: their storage stands for them
        key = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in sources)
        cache = self.__dict__.setdefault("_derived", {})
        if what not in cache or cache[what][0] != key:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the code predictor's {what} are made by an eager call: run the frame once "
                                   "before capturing it in a CUDA graph")
            with torch.no_grad():
                cache[what] = (key, make())
        return cache[what][1]

    def _rope_table(self, positions: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0..positions-1 (the same for every frame), made once per device and dtype, so a
        CUDA graph captured after the first call replays no rotary math."""
        key = (like.device, like.dtype, positions)
        if getattr(self, "_rope_cache_key", None) != key:
            table = torch.arange(positions, device=like.device)
            self._rope_cache = self.model.rotary.cos_sin(table, like.dtype)
            self._rope_cache_key = key
        return self._rope_cache
