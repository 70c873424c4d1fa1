"""DFlash (block diffusion): model.py (Qwen3 layers with the target's features injected as keys and values),
loss.py (random anchors, the block mask, decayed loss), draft.py (one forward per round, chains),
formats.py (the z-lab layout vLLM and SGLang read, speculators'; import of both)."""
from draftsmith.heads.dflash import formats
from draftsmith.heads.dflash.draft import DFlashDrafter
from draftsmith.heads.dflash.model import DFlashHead, default_layer_ids
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FeatureNeeds

SPEC = HeadSpec(kind="dflash", model=DFlashHead, drafter=DFlashDrafter, formats=formats,
                features=FeatureNeeds("layers", default_layer_ids))
