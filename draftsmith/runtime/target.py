"""Target wrapper for any Hugging Face causal LM: a preallocated static cache, prefill, a one-pass
verify over `prefix + tree` with 4-D tree masks and depth-based positions, and a single gather-copy that
commits the accepted path's KV.

The model's own modeling code runs unchanged: the tree enters only as `attention_mask` and
`position_ids`; hidden states come from forward hooks. Every layer type transformers defines is
taken from transformers itself: `get_layer_types_and_kwargs` says what each layer is, its masking
overlays (`sliding_window_overlay`, `chunked_overlay`) shape each attention type's mask, and models
with several types receive the dict of masks keyed by type that their forward reads.

- Attention layers of every type (full, sliding, chunked) keep the whole sequence's KV in a
  `StaticLayer`: a window or chunk is a mask over positions, never a truncation, so a tree's
  rejected nodes can be dropped and its accepted ones committed exactly, however many windows
  long the sequence grows. Sinks, soft-capping and NoPE layers are the model's own code.
- Recurrent layers (gated DeltaNet, Mamba-2, short convolutions) keep transformers' own
  linear-attention cache layers. They advance over a chain only; trees are refused on these targets.
  Verification keeps every conv and recurrent state from before the chain and what each recurrent mixer
  reads over it (its layer's input). A chain kept whole keeps the states it left; one kept in part
  gets the states after its last accepted position by running only the recurrent mixers again over
  the accepted positions of their recorded inputs: no other layer and no second target forward.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers.cache_utils import (STATIC_LAYER_TYPE_MAPPING, Cache, LinearAttentionCacheLayerMixin, StaticLayer,
                                      get_layer_types_and_kwargs)
from transformers.masking_utils import chunked_overlay, sliding_window_overlay

from draftsmith.runtime.compile import maybe_compile
from draftsmith.targets.features import FeatureExtractor, language_model_inputs

ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
RECURRENT_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding"}
# what transformers' hybrid decoder layers call their recurrent mixer (gated DeltaNet, Mamba-2, short conv)
MIXER_NAMES = ("linear_attn", "mamba", "mixer", "conv")


def recurrent_mixers(decoder, cache_types: list[str]) -> dict[int, torch.nn.Module]:
    """The module of each recurrent layer that reads and writes its conv and recurrent states."""
    mixers = {}
    for i, (layer, cache_type) in enumerate(zip(decoder.layers, cache_types)):
        if cache_type in RECURRENT_TYPES:
            found = [getattr(layer, name) for name in MIXER_NAMES if isinstance(getattr(layer, name, None), torch.nn.Module)]
            if not found:
                raise ValueError(f"{type(layer).__name__} (layer {i}, a {cache_type!r} layer): no recurrent mixer found "
                                 f"under any of {list(MIXER_NAMES)}")
            mixers[i] = found[0]
    return mixers


class FilledLayer(StaticLayer):
    """transformers' `StaticLayer`, whose attention reads only the first `visible` slots (the committed prefix and
    the block being run) where the runner sets it: a decode step then scores the keys it can see, not the whole
    preallocated length, as `generate`'s dynamic cache does. Left unset (fixed shapes for CUDA graphs) it is a
    `StaticLayer`."""
    visible: int | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.visible is None:
            return keys, values
        return keys[:, :, :self.visible], values[:, :, :self.visible]


def layer_states(layer) -> tuple[dict, dict]:
    return tuple({i: s.clone() for i, s in store.items() if s is not None}
                 for store in (layer.conv_states, layer.recurrent_states))


def same_image(token_types_T: torch.Tensor) -> torch.Tensor:
    """[T, T]: true where query and key are tokens of the same image (a run of token type 1), the blocks a prefill
    lets attend both ways in models that read token types (Gemma 3); windows still apply on top (`masks`)."""
    is_image = token_types_T == 1
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:-1]
    group = torch.where(is_image, torch.cumsum(starts.long(), 0), torch.zeros_like(token_types_T))
    return (group[:, None] == group[None, :]) & is_image[:, None] & is_image[None, :]


class LayerLayout:
    """What each decoder layer of a target is, in transformers' own terms, and the masks it reads."""

    def __init__(self, config):
        text = config.get_text_config(decoder=True)
        self.cache_types, self.cache_kwargs = get_layer_types_and_kwargs(text)
        self.config_types = list(getattr(text, "layer_types", None) or self.cache_types)
        unknown = sorted(set(self.cache_types) - ATTENTION_TYPES - RECURRENT_TYPES - {"dummy"})
        if unknown:
            raise ValueError(f"{text.model_type}: layer types {unknown} are not supported by draftsmith's runtime "
                             f"(supported: {sorted(ATTENTION_TYPES | RECURRENT_TYPES)})")
        # the overlay (on top of the tree/causal visibility) of each attention type, by the name the model reads
        self.overlays = {}
        for cache_type, kwargs in zip(self.cache_types, self.cache_kwargs):
            if cache_type == "sliding_attention":
                self.overlays["sliding_attention"] = ("sliding", kwargs["sliding_window"])
            elif cache_type == "chunked_attention":
                self.overlays["chunked_attention"] = ("chunked", kwargs["sliding_window"])
            elif cache_type == "hybrid_sliding":
                self.overlays["full_attention"] = ("sliding", kwargs["sliding_window"])
            elif cache_type in ("full_attention", "hybrid"):
                self.overlays.setdefault("full_attention", None)
        self.recurrent = any(t in RECURRENT_TYPES for t in self.cache_types)
        # one mask for every layer where every layer is of one attention type (the models without a dict)
        self.single = len(set(self.cache_types)) == 1 and self.cache_types[0] in ATTENTION_TYPES

    def cache(self, max_len: int) -> Cache:
        layers = []
        for cache_type, kwargs in zip(self.cache_types, self.cache_kwargs):
            if cache_type in ATTENTION_TYPES:
                layers.append(FilledLayer(max_cache_len=max_len))
            elif cache_type in ("hybrid", "hybrid_sliding"):
                layers.append(STATIC_LAYER_TYPE_MAPPING["hybrid"](max_cache_len=max_len, **{
                    k: v for k, v in kwargs.items() if k != "sliding_window"}))
            else:
                layers.append(STATIC_LAYER_TYPE_MAPPING[cache_type](max_cache_len=max_len, **kwargs))
        return Cache(layers=layers)

    def masks(self, allowed_BNL: torch.Tensor, q_pos_BN: torch.Tensor, k_pos_BL: torch.Tensor, dtype):
        """Additive [B, 1, N, L] masks: `allowed` (what the tree and the committed prefix let each query
        see) intersected with each type's own overlay over RoPE positions; a dict by layer type unless
        every layer is of one attention type."""
        B = allowed_BNL.shape[0]
        batch, q, k = torch.arange(B, device=allowed_BNL.device)[:, None, None], q_pos_BN[:, :, None], k_pos_BL[:, None, :]
        out = {}
        for name, overlay in self.overlays.items():
            visible = allowed_BNL
            if overlay is not None:
                kind, size = overlay
                fn = sliding_window_overlay(size) if kind == "sliding" else chunked_overlay(
                    size, torch.zeros(B, dtype=torch.long, device=allowed_BNL.device))
                visible = visible & fn(batch, 0, q, k)
            mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            out[name] = mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]
        if self.single:
            return next(iter(out.values()))
        for name in set(self.config_types) | {"linear_attention"}:
            out.setdefault(name, None)  # recurrent and MLP-only layers read no 4-D mask
        return out


class TargetRunner:
    """Static-cache driver. `length` (committed tokens) is host-side bookkeeping. The features it
    returns are what the head reads: the hidden states entering `layer_ids` concatenated, or with
    no layer ids the final normed hidden state."""

    def __init__(self, model, max_len: int, layer_ids: list[int], compile_mode: str | None = "auto"):
        self.model, self.max_len = model, max_len
        self.extractor = FeatureExtractor(model, layer_ids)
        self.device, self.dtype = model.device, model.dtype
        self.layout = LayerLayout(model.config)
        self.cache = self.layout.cache(max_len)
        # recurrent cache layers and their mixers by layer index; a verification keeps their states from before it
        # (`_snapshot`) and what each mixer read (`_inputs`)
        self.recurrent = {i: layer for i, layer in enumerate(self.cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)}
        self.mixers = recurrent_mixers(self.extractor.decoder, self.layout.cache_types) if self.recurrent else {}
        self._snapshot, self._inputs, self._chain_length = None, None, 0
        params = inspect.signature(self.extractor.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.lm_head = model.get_output_embeddings()
        self.length = 0
        # multimodal rotary positions (Qwen-VL's mrope): after an image prompt, text continues at its position plus this
        # offset on every axis (the model's rope_deltas); 0 otherwise
        self.rope_offset = 0
        # fixed-size forwards (plain decode N=1, tree verify N=num_nodes) become CUDA graphs on a GPU;
        # the prefill has a different length per prompt and stays eager
        self.decode_fixed = maybe_compile(self._decode, compile_mode, self.device)
        # eager forwards attend over the filled slots only (`FilledLayer`); CUDA graphs need one shape, the whole
        # length; so do layers that keep attention KV beside a recurrent state (transformers' hybrid cache layers)
        self.filled = [layer for layer in self.cache.layers if isinstance(layer, FilledLayer)]
        hybrid = any(t.startswith("hybrid") for t in self.layout.cache_types)
        self.trim = self.decode_fixed == self._decode and not hybrid

    def reset(self) -> None:
        self.cache.reset()
        self.length, self.rope_offset = 0, 0
        self._snapshot, self._inputs = None, None

    def _masks(self, tree_mask_BNN: torch.Tensor, lengths_B: torch.Tensor, scratch: int, depth_BN: torch.Tensor):
        """Row b sees its committed [0, lengths_b) and its own tree block at [scratch, scratch + N),
        whose keys sit at positions lengths_b + depth."""
        B, N, _ = tree_mask_BNN.shape
        width = self.max_len
        if self.trim:  # attention reads the filled slots only (`FilledLayer`)
            width = scratch + N
            for layer in self.filled:
                layer.visible = width
        slots = torch.arange(width, device=self.device)
        allowed = (slots[None, None, :] < lengths_B[:, None, None]).expand(B, N, width).clone()
        allowed[:, :, scratch:scratch + N] = tree_mask_BNN
        q_pos = lengths_B[:, None] + depth_BN
        k_pos = slots[None, :].expand(B, width).clone()
        k_pos[:, scratch:scratch + N] = q_pos
        return self.layout.masks(allowed, q_pos, k_pos, self.dtype)

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and getattr(layer, "cumulative_length", None) is not None:
                layer.cumulative_length.fill_(length)
        self.length = length

    def _decode(self, tokens_1N, positions_1N, masks, embeds_1ND=None, extra: dict | None = None, last: bool = False):
        """(logits fp32, features, final hidden) of the forward; `last`: logits of the last position only (a prefill,
        whose next token is all decoding reads: the lm_head over a whole prompt is as costly as a decode step)."""
        self.extractor._captured.clear()
        tokens = {"input_ids": tokens_1N} if embeds_1ND is None else {"inputs_embeds": embeds_1ND, **(extra or {})}
        out = self.extractor.decoder(**tokens, position_ids=positions_1N, attention_mask=masks,
                                     use_cache=True, **{self.cache_kwarg: self.cache})
        final = out.last_hidden_state[0]
        aux = self.extractor.aux()
        return self.lm_head(final[-1:] if last else final).float(), final if aux is None else aux[0], final

    def _refuse_trees(self, mask_BNN: torch.Tensor) -> None:
        """Recurrent layers advance over one sequence: each row must be a chain (node j sees every node
        before it), optionally followed by padding nodes that see only themselves."""
        N = mask_BNN.shape[-1]
        causal = torch.ones(N, N, dtype=torch.bool, device=mask_BNN.device).tril()
        seen = (mask_BNN & causal).sum(-1) - 1  # earlier nodes each node sees
        chain = seen == torch.arange(N, device=mask_BNN.device)
        ok = (bool(mask_BNN.diagonal(dim1=-2, dim2=-1).all()) and not bool((mask_BNN & ~causal).any())
              and bool((chain | (seen == 0)).all()) and bool((chain.int().diff(dim=-1) <= 0).all()))
        if not ok:
            raise ValueError(f"{self.model.config.model_type} has recurrent layers, which advance over one chain: "
                             "draft chains (validate.top_k: 1), not trees")

    def _take_snapshot(self) -> None:
        """Every conv and recurrent state as it is before a chain runs, and whether each layer had one."""
        self._snapshot = {i: (layer_states(layer), dict(layer.has_previous_state)) for i, layer in self.recurrent.items()}
        self._inputs = None

    @contextmanager
    def _recording_mixer_inputs(self):
        """Inside: what each recurrent mixer is called with (its layer's input over the chain) is kept in `_inputs`."""
        self._inputs = {}

        def keep(i):
            def hook(_module, args, kwargs):
                self._inputs[i] = (args, kwargs)
            return hook
        hooks = [module.register_forward_pre_hook(keep(i), with_kwargs=True) for i, module in self.mixers.items()]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _run_mixer(self, i: int, start: int, end: int) -> None:
        """Layer i's recurrent mixer over positions [start, end) of the chain it last verified, from its current
        states (its output is not needed: only the states it leaves)."""
        args, kwargs = self._inputs[i]
        hidden, rest = (kwargs["hidden_states"], args) if "hidden_states" in kwargs else (args[0], args[1:])
        N = hidden.shape[1]
        sliced = {k: v[:, start:end] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == N else v
                  for k, v in kwargs.items() if k != "hidden_states"}  # 2-D per-position arguments: padding masks
        self.mixers[i](hidden[:, start:end], *rest, **sliced)

    def _keep_states(self, accepted_B: list[int]) -> None:
        """Row b's conv and recurrent states become those after the first accepted_b positions of the chain last
        verified: the chain's own for a whole chain, the states before it for none, and for a chain kept in part
        the recurrent mixers (only they) run again over the kept positions of their recorded inputs, from the
        states before the chain, in segments ending at each distinct kept length (a state cannot skip padding)."""
        snapshot, inputs, N = self._snapshot, self._inputs, self._chain_length
        if snapshot is None or all(a == N for a in accepted_B):
            self._snapshot = self._inputs = None
            return
        partial = sorted({a for a in accepted_B if 0 < a < N})
        if partial and inputs is None:
            raise RuntimeError(f"positions {partial} of {N} kept from a forward that recorded no recurrent inputs")
        for i, layer in self.recurrent.items():
            (before, previous), after = snapshot[i], layer_states(layer)
            at = {0: before, N: after}
            if partial:
                self._assign(layer, before)
                start = 0
                for end in partial:
                    self._run_mixer(i, start, end)
                    at[end], start = layer_states(layer), end
            self._select_rows(layer, at, accepted_B)
            if not any(accepted_B):
                layer.has_previous_state.update(previous)
        self._snapshot = self._inputs = None

    @staticmethod
    def _select_rows(layer, at: dict, lengths_B: list[int]) -> None:
        """Row b of every state of `layer` taken from at[lengths_B[b]] (a `layer_states` copy per length)."""
        for store, k in ((layer.conv_states, 0), (layer.recurrent_states, 1)):
            for idx, state in store.items():
                if state is not None:
                    for b, length in enumerate(lengths_B):
                        state[b].copy_(at[length][k][idx][b])

    @staticmethod
    def _assign(layer, states: tuple[dict, dict]) -> None:
        for store, saved in zip((layer.conv_states, layer.recurrent_states), states):
            for idx, state in saved.items():
                store[idx].copy_(state)

    @torch.no_grad()
    def forward(self, tokens_N: torch.Tensor, depth_N: torch.Tensor, tree_mask_NN: torch.Tensor, fixed: bool = True,
                embeds_ND: torch.Tensor | None = None, rope_positions=None, extra: dict | None = None, last: bool = False):
        """Run tokens at positions length+depth; returns (logits_NV fp32, features_NK, final_NH).
        Their KV sits at [length, length+N) until `commit` keeps the accepted ones. `embeds_ND`: the tokens'
        input embeddings as the model made them (an image prompt's), instead of the ids'; `rope_positions`: the
        rotary positions the model made for them (Qwen-VL's 3 x 1 x N), instead of length+depth; `extra`: what else the
        model gives its decoder with them (Qwen3-VL's deepstack features); `last`: logits of the last token only."""
        if self.length + len(tokens_N) > self.max_len:
            raise ValueError(f"sequence of {self.length + len(tokens_N)} tokens exceeds the runtime's max_len={self.max_len}")
        self._set_length(self.length)
        lengths = torch.tensor([self.length], device=self.device)
        positions = (self.length + self.rope_offset + depth_N)[None] if rope_positions is None else rope_positions
        return self._run(tokens_N[None], positions, tree_mask_NN[None],
                         self._masks(tree_mask_NN[None], lengths, self.length, depth_N[None]), fixed,
                         None if embeds_ND is None else embeds_ND[None], extra, last)

    def _run(self, tokens_BN, positions_BN, tree_mask_BNN, masks, fixed: bool, embeds_BND=None, extra=None, last=False):
        """The target's forward; on a recurrent target the states are kept before it and, in a verification
        (`fixed`) of several positions, what each recurrent mixer reads (run eagerly: hooks keep Python state)."""
        if embeds_BND is not None:
            if self.recurrent:
                raise ValueError("image prompts on a target with recurrent layers are not supported yet (issue #52)")
            return self._decode(tokens_BN, positions_BN, masks, embeds_BND, extra, last)
        if not self.recurrent:
            if fixed:
                return self.decode_fixed(tokens_BN, positions_BN, masks)
            return self._decode(tokens_BN, positions_BN, masks, last=last)
        self._refuse_trees(tree_mask_BNN)
        self._take_snapshot()
        self._chain_length = tokens_BN.shape[1]
        if not fixed or tokens_BN.shape[1] == 1:
            return self._decode(tokens_BN, positions_BN, masks, last=last)
        with self._recording_mixer_inputs():
            return self._decode(tokens_BN, positions_BN, masks)

    def prefill(self, prompt_T: torch.Tensor, image_inputs: dict | None = None):
        """The prompt's forward: (logits of its last position [1, V], features, final hidden). An image prompt
        (`image_inputs`: its pixel values, as the target's image processor made them) enters with the embeddings the
        model's own code builds from the ids and the images."""
        T = len(prompt_T)
        causal = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        if image_inputs and "token_type_ids" in image_inputs:  # Gemma 3: each image's tokens see each other both ways
            causal = causal | same_image(image_inputs["token_type_ids"][0].to(self.device))
        embeds, positions, extra = language_model_inputs(self.model, prompt_T[None], image_inputs) if image_inputs else (None, None, None)
        logits, aux, final = self.forward(prompt_T, torch.arange(T, device=self.device), causal, fixed=False,
                                          embeds_ND=None if embeds is None else embeds[0], rope_positions=positions, extra=extra,
                                          last=True)
        self.rope_offset = 0 if positions is None else int(positions.max()) + 1 - T
        self.commit(torch.arange(T, device=self.device))
        return logits, aux, final

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (the KV stays, to be overwritten). Attention layers only:
        a recurrent state cannot go back further than the last chain's start."""
        if self.recurrent and length != self.length:
            raise ValueError("a target with recurrent layers cannot be truncated")
        self._set_length(length)

    def commit(self, node_idx_A: torch.Tensor) -> None:
        """Keep the KV of the accepted tree nodes (indices into the last forward's N tokens)."""
        if self.recurrent:
            self._keep_states([len(node_idx_A)])
        src = self.length + node_idx_A
        dst = torch.arange(self.length, self.length + len(node_idx_A), device=self.device)
        if self.device.type == "cpu" and torch.equal(src, dst):  # a plain step or a chain's prefix: the KV is in place
            self._set_length(self.length + len(node_idx_A))      # (on CUDA the copy is cheaper than the host sync)
            return
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None:
                continue
            layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
            layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        self._set_length(self.length + len(node_idx_A))
