"""P-EAGLE (parallel EAGLE): model.py (EAGLE-3 layers plus a learned mask state, N layers), loss.py (COD sampling
over depths), draft.py (one forward per round, chains), formats.py (vLLM's EAGLE-3 with parallel drafting,
speculators' peagle; import of both)."""
from draftsmith.heads.peagle import formats
from draftsmith.heads.peagle.draft import PEagleDrafter
from draftsmith.heads.peagle.model import PEagleHead, default_layer_ids
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FeatureNeeds

SPEC = HeadSpec(kind="peagle", model=PEagleHead, drafter=PEagleDrafter, formats=formats,
                features=FeatureNeeds("layers", default_layer_ids))
