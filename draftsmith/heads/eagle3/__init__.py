from draftsmith.heads.eagle3.model import Eagle3Head  # noqa: F401
