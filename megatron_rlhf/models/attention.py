"""Core attention for the layer spec without Transformer Engine (CPU): megatron-core's local
`DotProductAttention`, computed with `torch.nn.functional.scaled_dot_product_attention`.

Why: megatron's local core attention materialises the [b, heads, sq, skv] scores with
`baddbmm`, copies the key/value heads for grouped-query attention, and masks and normalises
with an unfused softmax whose probabilities are kept for backward. SDPA runs the same math in
torch's CPU flash kernel (causal or bool mask, native GQA; with dropout it falls back to
torch's unfused math): core attention 2-3x faster (measured, torch 2.13, 1 thread), a
2-layer hidden-128 model's forward+backward 1.75x faster at 512 tokens, 32-token KV-cached
decoding ~12% faster. Megatron's module keeps its place in the spec, its constructor, its
per-partition sizes and its checkpoint behaviour; only `forward` changes.

What it matches, per call (`attention_mask` is megatron's bool mask, True = masked):
- scale: megatron's (config.softmax_scale, else 1/sqrt(kv_channels)); query-key layer
  scaling divides the scores by the layer number and multiplies them back inside the fp32
  softmax, so it does not change the math and is not applied here.
- which keys a query sees: `visible_keys` (attention_masks.py). With an explicit `attention_mask` that mask
  alone (as megatron's local softmax does: the caller's mask carries its own causality); else
  causal for a causal module (bottom-right aligned when queries are a chunk after cached keys,
  sq < skv, which megatron's local softmax cannot do: it asserts sq == skv); and a sliding
  window (config.window_size) when the layer has one.
- dropout on the attention probabilities when training, under megatron's model-parallel RNG
  fork; the same distribution as megatron's, not the same bits (SDPA draws its own mask).

Where it deliberately differs from megatron's local softmax, in rows nobody reads:
- a query row whose keys are all masked (e.g. a padding query) gives zeros; megatron's
  masked_fill(-10000) gives the mean of all values. Unmasked rows do not depend on it.
- with a sliding window AND an explicit mask, both apply; megatron's local softmax drops the
  explicit mask there (TE honours both).
- a negative window side is unbounded, as TransformerConfig.window_size documents (-1 =
  infinite); megatron's local mask builder turns -1 into a mask that hides the diagonal.

Packed sequences (THD, `packed_seq_params.qkv_format == "thd"`: several sequences in one
row, models/microbatches.py: pack_rows): megatron hands core attention [t, heads, dim] and
reshapes what comes back to [t, 1, hidden]; a query sees the keys of its own sequence
(cu_seqlens_q == cu_seqlens_kv, both required) at or before it: a block-diagonal causal mask
(`packed_visible_keys`), so one SDPA call runs every sequence of the row. megatron's local
DotProductAttention asserts packed_seq_params is None; on the GPU, TE's attention takes the
same PackedSeqParams natively.

Refused with NotImplementedError, never approximated: attention_bias, softmax_type other than
'vanilla', the padding_causal mask type, and packed sequences with an explicit mask or with
different query and key boundaries. (Context parallelism is refused by megatron's constructor
already.)
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_rlhf.attention_masks import visible_keys

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
# Module mask types whose only masking is the caller's explicit mask (or none).
_EXPLICIT_ONLY_TYPES = (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary)


class SDPADotProductAttention(DotProductAttention):
    """megatron-core's local DotProductAttention computed with torch's
    scaled_dot_product_attention (see the module docstring for what it matches).
    Input query [sq, b, heads/TP, head_dim], key/value [skv, b, groups/TP, head_dim];
    output [sq, b, heads/TP * head_dim]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"SDPADotProductAttention: softmax_type={config.softmax_type!r} (a softmax "
                                      "offset) is not supported; only 'vanilla'")
        if attn_mask_type not in _CAUSAL_TYPES + _EXPLICIT_ONLY_TYPES:
            raise NotImplementedError(f"SDPADotProductAttention: attn_mask_type={attn_mask_type} is not supported "
                                      "(padding_causal belongs to packed THD sequences)")
        self.causal = attn_mask_type in _CAUSAL_TYPES
        # The scale before megatron divides it by the layer number for query-key layer scaling
        # (undone in its fp32 softmax): one multiplication here, no rounding of scale / L * L.
        self.sdpa_scale = (softmax_scale if softmax_scale is not None
                           else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.window_size = (tuple(config.window_size)
                            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
                            else None)
        self.grouped = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # attn_mask_type (per call) is ignored, as megatron's local DotProductAttention ignores
        # it: static inference passes no_mask for every step after the prompt, which is right
        # only for one-token steps; the module's own (causal) type, bottom-right aligned, is
        # right for any chunk after cached keys.
        if attention_bias is not None:
            raise NotImplementedError("SDPADotProductAttention: attention_bias is not supported")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        if packed_seq_params is not None:
            raise NotImplementedError(f"SDPADotProductAttention: packed_seq_params with qkv_format="
                                      f"{packed_seq_params.qkv_format!r}: only 'thd' is supported")
        sq, batch, skv = query.size(0), query.size(1), key.size(0)
        visible, is_causal = self._visible(attention_mask, sq, skv, query.device)
        # [s, b, n, d] -> [b, n, s, d]: SDPA's layout, as strided views (no copies).
        context = self._attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), visible, is_causal)
        # [b, n, sq, d] -> [sq, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.hidden_size_per_partition)

    def _packed(self, query, key, value, attention_mask, params) -> torch.Tensor:
        """THD: query [t, heads/TP, d], key/value [t, groups/TP, d] of sequences packed back to
        back (params.cu_seqlens_q) -> [t, 1, heads/TP * d]."""
        if attention_mask is not None:
            raise NotImplementedError("SDPADotProductAttention: packed sequences take their mask from cu_seqlens; "
                                      "an explicit attention_mask is not supported with them")
        cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu_seqlens and not torch.equal(cu_kv, cu_seqlens):
            raise NotImplementedError("SDPADotProductAttention: packed self-attention needs cu_seqlens_kv == "
                                      "cu_seqlens_q")
        tokens = query.size(0)
        visible = packed_visible_keys(cu_seqlens, tokens)
        if self.window_size is not None:  # within a sequence, index distance is position distance
            visible = visible & visible_keys(tokens, tokens, self.window_size, query.device)
        # [t, n, d] -> [1, n, t, d]
        context = self._attend(*(t.transpose(0, 1).unsqueeze(0) for t in (query, key, value)), visible, False)
        return context.squeeze(0).transpose(0, 1).reshape(tokens, 1, self.hidden_size_per_partition)

    def _attend(self, q, k, v, visible, is_causal) -> torch.Tensor:
        """SDPA on [b, n, s, d] views, with megatron's dropout stream when training."""
        dropout = self.attention_dropout.p if self.training else 0.0

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, is_causal=is_causal,
                                                  scale=self.sdpa_scale, enable_gqa=self.grouped)

        if dropout > 0.0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the model-parallel RNG stream (heads differ
            # per TP rank); with sequence parallelism, from the default one.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return attend()
        return attend()

    def _visible(self, attention_mask, sq: int, skv: int, device) -> tuple[torch.Tensor | None, bool]:
        """(SDPA attn_mask: True = attend, or None; is_causal) for this call."""
        window = self.window_size
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"SDPADotProductAttention: attention_mask must be bool (True = masked, megatron's "
                                f"convention), got {attention_mask.dtype}")
            visible = ~attention_mask
            if window is not None:
                visible = visible & visible_keys(sq, skv, window, device)
            return visible, False
        if window is not None:
            return visible_keys(sq, skv, window, device), False
        if not self.causal or sq == 1:  # one query after its keys sees them all
            return None, False
        if sq == skv:
            return None, True  # SDPA's is_causal is top-left aligned: right only when sq == skv
        return visible_keys(sq, skv, device=device), False


def packed_visible_keys(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens, tokens] bool, True where query i may see key j: the same packed sequence
    (boundaries `cu_seqlens` [n + 1], starting at 0) and j <= i. Tokens past cu_seqlens[-1]
    form one more sequence of their own (padding nobody reads)."""
    index = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].to(index.dtype), index, right=True)  # which sequence each token is in
    return (sequence[:, None] == sequence[None, :]) & (index[None, :] <= index[:, None])


def inference_chunk_mask_type(layer_mask_type: AttnMaskType, call_mask_type: AttnMaskType | None,
                              queries: int) -> AttnMaskType | None:
    """The mask type a core-attention call should use. megatron's static inference passes
    `no_mask` for every forward after its first (the keys before the queries are cached), which
    is right for one query only: a chunk of queries after cached keys (a multi-turn episode's
    observation, rollout/megatron_engine.py TurnCache) of a causal layer needs the causal mask
    aligned to the bottom right (query i sees the cached keys and the chunk's keys up to i).
    That alignment is also right for one query and for queries == keys, so it is applied
    whenever a causal layer is called with no_mask and more than one query."""
    if call_mask_type == AttnMaskType.no_mask and layer_mask_type in _CAUSAL_TYPES and queries > 1:
        return AttnMaskType.causal_bottom_right
    return call_mask_type


@functools.cache
def te_chunked_inference_attention():
    """megatron's TEDotProductAttention (GPU spec) whose calls go through
    inference_chunk_mask_type: the class, built here because importing it imports Transformer
    Engine (GPU nodes only). What SDPADotProductAttention does on CPU by ignoring the per-call
    type; `make gpu-check` compares multi-turn episodes with and without the turn cache."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TEChunkedInferenceAttention(TEDotProductAttention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # megatron builds core attention with keywords (transformer/attention.py)
            self.layer_mask_type = kwargs["attn_mask_type"] if "attn_mask_type" in kwargs else args[2]

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, *args, **kwargs):
            # static inference: [sq, b, heads, dim] (sbhd); packed THD never comes with no_mask
            attn_mask_type = inference_chunk_mask_type(self.layer_mask_type, attn_mask_type, query.size(0))
            return super().forward(query, key, value, attention_mask, attn_mask_type, *args, **kwargs)

    return TEChunkedInferenceAttention
