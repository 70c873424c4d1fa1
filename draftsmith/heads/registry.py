"""One registry: head kind -> `HeadSpec`, the small object that names a kind's parts. Adding a kind
is adding a package under heads/ that defines `SPEC`, plus its line in `PACKAGES`.

A kind's package holds everything about it:
  model.py    the module and its config: `from_target(target_config, head_cfg, layer_ids)`,
              `from_config(config)`, `loss(batch) -> (loss, metrics)`, `draft_config()`,
              `trainable_state()`, `set_vocab(d2t, t2d)`, `load_target_weights(embed, lm_head)`
  loss.py     its training objective
  draft.py    its drafter for the runtime (heads/drafting.py's interface)
  formats.py  engine export adapters (`ADAPTERS`, `REQUIRED`, `model_card`, `serve_command`) and
              import of published layouts (`recognizes(config)`, `import_layout(path, config, target_config)`)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from draftsmith.targets.features import FeatureNeeds

PACKAGES = {
    "dflash": "draftsmith.heads.dflash",
    "eagle2": "draftsmith.heads.eagle2",
    "eagle3": "draftsmith.heads.eagle3",
    "medusa": "draftsmith.heads.medusa",
    "mtp": "draftsmith.heads.mtp",
    "peagle": "draftsmith.heads.peagle",
}


@dataclass(frozen=True)
class HeadSpec:
    kind: str
    model: type            # the nn.Module class
    drafter: type          # implements heads.drafting.Drafter
    formats: ModuleType    # the kind's formats module
    features: FeatureNeeds  # what capture stores / the runtime feeds the drafter


def known_kinds() -> list[str]:
    return sorted(PACKAGES)


def head_spec(kind: str) -> HeadSpec:
    if kind not in PACKAGES:
        raise ValueError(f"head.kind={kind!r} is not a known head kind; valid kinds: {', '.join(known_kinds())}")
    return importlib.import_module(PACKAGES[kind]).SPEC


def capture_needs(kind: str) -> FeatureNeeds:
    """What the capture stage stores for `kind`."""
    return head_spec(kind).features


def get_head_class(kind: str) -> type:
    return head_spec(kind).model


def spec_for_layout(config: dict, where: str) -> HeadSpec:
    """The kind whose formats module recognizes an exported/published config.json."""
    for kind in known_kinds():
        spec = head_spec(kind)
        if spec.formats.recognizes(config):
            return spec
    raise ValueError(f"{where}: config.json matches no known head layout ({', '.join(known_kinds())})")
