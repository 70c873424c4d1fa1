"""Medusa-1 and Medusa-2: model.py (K residual heads on the target's final feature), loss.py
(decayed soft CE per head, per-head top-k accuracy), draft.py (static trees from choice lists or
measured accuracies; sampled drafts as proposals), formats.py (vLLM `medusa`, the FasterDecoding
layout TGI and TensorRT-LLM read, Medusa-2's merged target and LoRA adapter; import of published
heads). Medusa-2's joint LoRA training is the trainer's (train/joint.py), shared with MTP."""
from draftsmith.heads.medusa import formats
from draftsmith.heads.medusa.draft import MedusaDrafter
from draftsmith.heads.medusa.model import MedusaHead
from draftsmith.heads.registry import HeadSpec
from draftsmith.targets.features import FINAL

SPEC = HeadSpec(kind="medusa", model=MedusaHead, drafter=MedusaDrafter, formats=formats, features=FINAL)
