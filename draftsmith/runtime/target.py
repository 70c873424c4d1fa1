"""Target wrapper for any Hugging Face causal LM: a preallocated static KV cache, prefill, a
one-pass verify over `prefix + tree` with a 4-D tree mask and depth-based positions, and a
single gather-copy that commits the accepted path's KV.

The model's own modeling code runs unchanged: the tree enters only as `attention_mask` (4-D
masks are used as-is) and `position_ids`; hidden states come from forward hooks."""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, StaticLayer

from draftsmith.runtime.compile import maybe_compile
from draftsmith.targets.features import FeatureExtractor


class TargetRunner:
    """Static-cache driver. `length` (committed tokens) is host-side bookkeeping. The features it
    returns are what the head reads: the hidden states entering `layer_ids` concatenated, or with
    no layer ids the final normed hidden state."""

    def __init__(self, model, max_len: int, layer_ids: list[int], compile_mode: str | None = "auto"):
        self.model, self.max_len = model, max_len
        self.extractor = FeatureExtractor(model, layer_ids)
        self.device, self.dtype = model.device, model.dtype
        self.cache = self._full_attention_cache(model.config, max_len)
        params = inspect.signature(self.extractor.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lm_head = model.get_output_embeddings()
        self.length = 0
        # fixed-size forwards (plain decode N=1, tree verify N=num_nodes) become CUDA graphs on a GPU;
        # the prefill has a different length per prompt and stays eager
        self.decode_fixed = maybe_compile(self._decode, compile_mode, self.device)

    @staticmethod
    def _full_attention_cache(config, max_len: int) -> Cache:
        """One preallocated full-attention layer per decoder layer. A sliding window (Mistral, some
        Qwen2) changes nothing while the whole sequence fits in it, which is checked here."""
        text = config.get_text_config()
        window = getattr(text, "sliding_window", None)
        uses_window = window and any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ["sliding"]))
        if uses_window and getattr(text, "use_sliding_window", True) and max_len > window:
            raise ValueError(f"runtime length {max_len} exceeds the target's sliding window ({window}); "
                             "lower validate.max_new_tokens or use shorter prompts")
        return Cache(layers=[StaticLayer(max_cache_len=max_len) for _ in range(text.num_hidden_layers)])

    def reset(self) -> None:
        self.cache.reset()
        self.length = 0

    def _mask(self, tree_mask_NN: torch.Tensor) -> torch.Tensor:
        """Additive [1, 1, N, max_len] mask: all committed positions visible, then the tree block."""
        N = tree_mask_NN.shape[0]
        allowed = torch.zeros(N, self.max_len, dtype=torch.bool, device=self.device)
        allowed[:, :self.length] = True
        allowed[:, self.length:self.length + N] = tree_mask_NN
        mask = torch.zeros(N, self.max_len, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[None, None]

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)
        self.length = length

    def _decode(self, tokens_1N, positions_1N, mask_11NL):
        self.extractor._captured.clear()
        out = self.extractor.decoder(input_ids=tokens_1N, position_ids=positions_1N, attention_mask=mask_11NL,
                                     use_cache=True, **{self.cache_kwarg: self.cache})
        final = out.last_hidden_state[0]
        aux = self.extractor.aux()
        return self.lm_head(final).float(), final if aux is None else aux[0], final

    @torch.no_grad()
    def forward(self, tokens_N: torch.Tensor, depth_N: torch.Tensor, tree_mask_NN: torch.Tensor, fixed: bool = True):
        """Run tokens at positions length+depth; returns (logits_NV fp32, features_NK, final_NH).
        Their KV sits at [length, length+N) until `commit` keeps the accepted ones."""
        if self.length + len(tokens_N) > self.max_len:
            raise ValueError(f"sequence of {self.length + len(tokens_N)} tokens exceeds the runtime's max_len={self.max_len}")
        self._set_length(self.length)
        decode = self.decode_fixed if fixed else self._decode
        return decode(tokens_N[None], (self.length + depth_N)[None], self._mask(tree_mask_NN))

    def prefill(self, prompt_T: torch.Tensor):
        T = len(prompt_T)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        logits, aux, final = self.forward(prompt_T, torch.arange(T, device=self.device), causal, fixed=False)
        self.commit(torch.arange(T, device=self.device))
        return logits, aux, final

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the KV stays, to be overwritten)."""
        self._set_length(length)

    def commit(self, node_idx_A: torch.Tensor) -> None:
        """Keep the KV of the accepted tree nodes (indices into the last forward's N tokens)."""
        src = self.length + node_idx_A
        dst = torch.arange(self.length, self.length + len(node_idx_A), device=self.device)
        for layer in self.cache.layers:
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        self._set_length(self.length + len(node_idx_A))
