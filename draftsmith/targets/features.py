"""Features of the frozen target: forward hooks that read hidden states, the layer-id conventions,
and what a head kind needs from the target (`FeatureNeeds`).

Layer ids use the *input-to-layer* convention: id k is the hidden state entering decoder layer k,
i.e. Hugging Face `hidden_states[k]` (0 = embeddings). This is vLLM's and EAGLE's convention;
SGLang's config ids are ours minus one (its loader adds one), SpecForge's `output of layer` ids too.
Heads fed the final hidden state (EAGLE-1/2, Medusa, MTP) read HF `hidden_states[-1]`: the last
decoder layer's output after the final norm."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith.targets.parallel import full

CONVENTION = {
    "ours": "input-to-layer (HF hidden_states index)",
    "vllm": "same ids (aux_hidden_state_layers are input-to-layer)",
    "sglang": "config ids = ours - 1 (set_eagle3_layers_to_capture adds 1)",
    "specforge": "output-of-layer ids = ours - 1",
}


@dataclass(frozen=True)
class FeatureNeeds:
    """What a head kind reads from the target: `"layers"` (the hidden states entering the layers
    `default_layer_ids(num_layers)` or the recipe's `capture.layer_ids`) or `"final"` (the final
    normed hidden state; no layer ids)."""
    feature: str
    default_layer_ids: Callable[[int], list[int]] = lambda num_layers: []

    def __post_init__(self):
        assert self.feature in ("layers", "final"), self.feature


FINAL = FeatureNeeds("final")


def decoder_of(model):
    """The module holding the decoder layers (`layers`) wherever an architecture keeps it: usually what
    `get_decoder()` returns, `model` for Llama 4's text model (its get_decoder() returns the whole model),
    a multimodal wrapper's `language_model`."""
    inner = getattr(model, "model", None)
    for candidate in (model.get_decoder(), inner, getattr(inner, "language_model", None), getattr(model, "language_model", None)):
        if candidate is not None and isinstance(getattr(candidate, "layers", None), torch.nn.ModuleList):
            return candidate
    raise ValueError(f"{type(model).__name__}: no decoder layers (a `layers` list) found under get_decoder(), .model "
                     "or .language_model; draftsmith reads hidden states from the decoder layers")


class _Entered(Exception):
    """Raised by the hook that reads what a multimodal model hands its language model."""


@torch.no_grad()
def language_model_inputs(model, input_ids_BT: torch.Tensor, image_inputs: dict) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(input embeddings, multimodal rotary positions or None, other inputs) an image-text model hands its language
    model: text embeddings with the vision tower's features scattered over the image tokens; for Qwen-VL's mrope the
    3 x B x T (temporal, height, width) positions; what else the model gives its decoder for the prompt (Qwen3-VL's
    deepstack visual features and their positions). Computed by the model's own code: its forward runs up to the
    entry of the decoder and stops there."""
    seen = {}

    def grab(_module, _args, kwargs):
        seen.update(kwargs)
        raise _Entered

    handle = decoder_of(model).register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=input_ids_BT, use_cache=False, **image_inputs)
    except _Entered:
        pass
    finally:
        handle.remove()
    if "inputs_embeds" not in seen:
        raise ValueError(f"{type(model).__name__}: its language model was not called with inputs_embeds")
    positions = seen.get("position_ids")
    if positions is not None and positions.dim() == 3 and positions.shape[0] == 4:
        positions = positions[1:]  # Qwen's text positions come first, for packed masks; the rotation reads the other 3
    other = {k: v for k, v in seen.items() if v is not None and k not in _DECODER_OWN}
    return seen["inputs_embeds"], positions if positions is not None and positions.dim() == 3 else None, other


# what a runner gives the decoder itself (ids or embeddings, positions, masks, cache), never taken from the prompt's call
_DECODER_OWN = {"input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values", "use_cache",
                "return_dict", "output_hidden_states", "output_attentions", "cache_position", "text_position_ids"}


class Skip(torch.nn.Module):
    """Stands in for a decoder layer whose output nobody reads: passes the hidden state through, in the
    form the layer returns it (a tensor, or a one-tuple for decoders that read `layer_outputs[0]`, as
    Falcon-H1's does)."""

    def __init__(self, as_tuple: bool = False):
        super().__init__()
        self.as_tuple = as_tuple

    @classmethod
    def for_decoder(cls, decoder: torch.nn.Module, layer: torch.nn.Module | None = None) -> "Skip":
        """The form this decoder's loop reads its layers' outputs in (annotations are not reliable), with the
        plain attributes of the layer it stands in for (the loop may read them: Nemotron-H's `block_type`)."""
        import inspect
        try:
            source = inspect.getsource(type(decoder).forward)
        except (OSError, TypeError):
            source = ""
        skip = cls(as_tuple="layer_outputs[0]" in source)
        for name, value in (vars(layer) if layer is not None else {}).items():
            if not name.startswith("_") and isinstance(value, (str, int, float, bool)) and name not in ("training", "as_tuple"):
                setattr(skip, name, value)
        return skip

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.as_tuple else hidden_states


class FeatureExtractor:
    """Runs the frozen target's decoder once and returns (aux_BTK, final_BTH) through forward hooks.

    The same object serves offline capture and online training, so both see identical tensors.
    `stop_after_features` skips the decoder layers above the highest id (final is then None)."""

    def __init__(self, model, layer_ids: list[int], stop_after_features: bool = False, chunk_tokens: int | None = None):
        self.model, self.layer_ids, self.chunk_tokens = model, layer_ids, chunk_tokens
        self.decoder = decoder_of(model)
        self._captured: dict[int, torch.Tensor] = {}
        self.handles = [self.decoder.register_forward_hook(self._keep_final)]
        for k in layer_ids:
            module = self.decoder.get_input_embeddings() if k == 0 else self.decoder.layers[k - 1]
            self.handles.append(module.register_forward_hook(self._hook(k)))
        self.skipped = range(max(layer_ids), len(self.decoder.layers)) if stop_after_features and layer_ids else range(0)

    def remove(self) -> None:
        """Detach from the model (another extractor may use it next)."""
        for handle in self.handles:
            handle.remove()

    def _hook(self, k: int):
        def store(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            # a tensor-parallel target keeps the residual stream replicated; were it sharded (a DTensor),
            # the feature is gathered to the full tensor here, so every layout stores the same values
            self._captured[k] = full(hidden)
        return store

    def _keep_final(self, _module, _inputs, output):
        self._final = output.last_hidden_state

    @torch.no_grad()
    def __call__(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, **image_inputs):
        """One forward of the whole model (the decoder's output read by a hook, the logits of the last
        position only): a target whose replicas transformers wraps with FSDP2 (target.parallel with
        data parallelism) runs only through its root module. `image_inputs` (an image-text target's pixel
        values and the like) go to the model as its processor made them."""
        self._captured.clear()
        self._final = None
        layers = self.decoder.layers
        kept = {i: layers[i] for i in self.skipped}
        try:
            for i in self.skipped:
                layers[i] = Skip.for_decoder(self.decoder, layers[i])
            T, C = input_ids_BT.shape[1], self.chunk_tokens
            if C and T > C:
                if image_inputs:
                    raise ValueError("capture.chunk_tokens: samples with images are captured in one forward; "
                                     "set capture.chunk_tokens: null (or above the longest sample) for image-text data")
                return self._by_chunks(input_ids_BT, attention_mask_BT, C)
            self.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False, logits_to_keep=1,
                       **image_inputs)
        finally:
            for i, layer in kept.items():
                layers[i] = layer
        return self.aux(), None if self.skipped else self._final

    def _by_chunks(self, ids_BT, mask_BT, chunk: int):
        """The forward in chunks of positions over the model's own cache (its KV, windowed and recurrent layers'
        states), as a prefill in pieces: activations of one chunk at a time, features concatenated."""
        import inspect
        cache_kwarg = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        auxes, finals, cache = [], [], None
        for start in range(0, ids_BT.shape[1], chunk):
            end = min(ids_BT.shape[1], start + chunk)
            self._captured.clear()
            mask = None if mask_BT is None else mask_BT[:, :end]
            out = self.model(input_ids=ids_BT[:, start:end], attention_mask=mask, use_cache=True, logits_to_keep=1,
                             **{cache_kwarg: cache})
            cache = out.past_key_values
            auxes.append(self.aux())
            finals.append(self._final)
        aux = torch.cat(auxes, dim=1) if self.layer_ids else None
        return aux, None if self.skipped else torch.cat(finals, dim=1)

    def aux(self) -> torch.Tensor | None:
        """The hooked layers' outputs of the last forward, concatenated low to high."""
        return torch.cat([self._captured[k] for k in self.layer_ids], dim=-1) if self.layer_ids else None


class FeatureCompleter:
    """Rebuilds what a compact store leaves out, on the training device, in one decoder pass over a
    partial target (`target.load_target_layers`, layers ids[0]..ids[-1]-1 never loaded): the low
    feature comes out of the first ids[0] layers, the stored high feature is fed into layer ids[-1],
    and the final norm after the last layer gives the teacher."""

    def __init__(self, model, layer_ids: list[int]):
        self.low = FeatureExtractor(model, layer_ids[:1])
        self.hidden = model.config.get_text_config().hidden_size
        self.dtype = model.get_input_embeddings().weight.dtype
        self._high: torch.Tensor | None = None
        self._fed = False
        decoder_of(model).layers[layer_ids[-1]].register_forward_pre_hook(self._feed, with_kwargs=True)

    def _feed(self, _module, args, kwargs):
        """Replace the hidden state entering layer ids[-1] with the stored high feature."""
        self._fed = True
        if args:
            return (self._high,) + tuple(args[1:]), kwargs
        return args, kwargs | {"hidden_states": self._high}

    @torch.no_grad()
    def __call__(self, batch: dict) -> dict:
        """`batch["aux"]` holds the stored features (low feature left out); returns the batch with the
        full aux (low to high) and the teacher hidden state at every position."""
        stored = batch["aux"]
        self._high, self._fed = stored[..., -self.hidden:].to(self.dtype).contiguous(), False
        low, teacher = self.low(batch["input_ids"])
        if not self._fed:
            raise RuntimeError("the target's decoder never ran its layers as expected; set capture.recompute: false")
        self._high = None
        batch["aux"] = torch.cat([low.to(stored.dtype), stored], dim=-1)
        batch["teacher"] = teacher.float()
        return batch
