"""MTP: model.py (DeepSeek-style modules: enorm, hnorm, eh_proj, the target family's block, shared
head), loss.py (recursive soft CE, normalised beta^i step weights), draft.py (chains and dynamic
trees through the shared tree drafter), formats.py (DeepSeek/GLM NextN in a full target copy and as
a separate draft directory, speculators `mtp`; import of published MTP layers). Joint training with
LoRA is the trainer's (train/joint.py), shared with Medusa-2."""
from draftsmith.heads.mtp import formats
from draftsmith.heads.mtp.draft import MTPDrafter
from draftsmith.heads.mtp.model import MTPHead
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FINAL

SPEC = HeadSpec(kind="mtp", model=MTPHead, drafter=MTPDrafter, formats=formats, features=FINAL)
