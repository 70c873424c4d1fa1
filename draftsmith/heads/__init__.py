"""Draft heads (layer 3: imports recipe, artifacts and targets/, never data/, train/ or runtime/).

registry.py   kind -> HeadSpec (model, drafter, formats, what the target must supply)
drafting.py   the drafter interface the runtime talks to; tree.py the draft tree type
hf_layout.py  what the engines' layouts share
eagle3/       one package per kind: model.py, loss.py, draft.py, formats.py
"""
