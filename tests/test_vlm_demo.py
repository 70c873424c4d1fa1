"""The image-text demo (issue #52): the embedded tiny Llama with a CLIP tower in front (LLaVA's layout), trained on
stdlib source and on images of a function's start drawn one character a patch; its data (`data.builtin:
stdlib-images`, half the functions asked with an image) and the whole pipeline on a micro variant."""
import json

import pytest
import torch

from conftest import micro_recipe
from draftsmith.recipe import EmbeddedVisionConfig, RecipeError

VISION = ("target.embedded.vision={grid: 4, patch_size: 8, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
          "num_attention_heads: 2}")
MICRO_VLM = [VISION, "target.embedded.max_steps=8", "target.embedded.corpus_mb=0.1", "target.embedded.seq_len=48",
             "data.builtin=stdlib-images", "data.max_conversations=60", "data.max_length=96"]


def _inked(image, cfg: EmbeddedVisionConfig) -> list[list[bool]]:
    """Per grid cell: does it hold any dark pixel."""
    gray, cell = image.convert("L"), cfg.patch_size
    return [[gray.crop((c * cell, r * cell, (c + 1) * cell, (r + 1) * cell)).getextrema()[0] < 128 for c in range(cfg.grid)]
            for r in range(cfg.grid)]


def test_code_is_drawn_one_token_a_patch_row_by_row():
    from draftsmith.targets import code_images
    from draftsmith.targets.embedded import _train_tokenizer
    tokenizer = _train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300)
    cfg = EmbeddedVisionConfig(grid=4, patch_size=12)
    text = "def add(a, b):\nreturn a" + " + b" * 10
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cells = code_images.layout(text, cfg, tokenizer)
    line = next(i for i, t in enumerate(ids) if tokenizer.decode([t]).endswith("\n")) + 1  # tokens of the first line
    # one token a cell in order; the token ending the line starts the next row; what does not fit is cut
    assert [t for t in cells[:line] if t is not None] == ids[:line] and line <= cfg.grid * 2
    row = -(-line // cfg.grid) * cfg.grid
    assert all(t is None for t in cells[line:row]) and cells[row:] == ids[line:line + len(cells) - row]
    image = code_images.render(text, cfg, tokenizer)
    assert image.size == (48, 48)
    inked = [cell for row in _inked(image, cfg) for cell in row]
    assert inked == [t is not None for t in cells]


def test_stdlib_images_asks_half_the_functions_with_their_start_drawn(tmp_path):
    from draftsmith.data import conversations as conv
    from draftsmith.data.prepare import collect
    from draftsmith.targets import code_images
    from draftsmith.targets.embedded import _train_tokenizer
    _train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300).save_pretrained(tmp_path / "t")  # the target's
    recipe = micro_recipe(tmp_path, tmp_path / "t", VISION, "data.builtin=stdlib-images", "data.max_conversations=400")
    train, heldout, _ = collect(recipe, conv.SkipCounter(), reads_images=True)
    drawn = [c for c in train + heldout if isinstance(c["messages"][0]["content"], list)]
    assert 0.35 < len(drawn) / len(train + heldout) < 0.65
    assert [c["id"] for c in collect(recipe, conv.SkipCounter(), reads_images=True)[0]] == [c["id"] for c in train]
    first = drawn[0]
    image_part, text_part = first["messages"][0]["content"]
    assert image_part["type"] == "image" and image_part["image"].startswith("data:image/png;base64,")
    assert text_part == {"type": "text", "text": code_images.IMAGE_PROMPT}
    assert first["id"].endswith(":image")
    # the answer is the function the image begins: its source starts with the drawn signature's name
    name = first["id"].split(":")[-3]
    assert f"def {name}(" in first["messages"][1]["content"]


def test_the_reading_loss_teaches_the_tower_which_token_each_patch_holds():
    """The per-patch loss alone, 250 steps on a few signatures: each patch's feature, scored against the
    language model's input embeddings, comes to pick the token drawn in it (chance is 1 in the vocabulary)."""
    from draftsmith.recipe import EmbeddedTargetConfig
    from draftsmith.targets import embedded
    torch.manual_seed(0)
    cfg = EmbeddedTargetConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, batch_size=4, seq_len=64,
                               vision=EmbeddedVisionConfig(grid=4, patch_size=8, hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=1, num_attention_heads=2))
    names = ["def add(a, b)", "def sub(x)", "def run(self)", "def get(key)", "def put(k, v)", "def pop(i)"]
    tokenizer = embedded._train_tokenizer(names * 5, cfg.vocab_size, image_token=True)
    model, processor = embedded._model(cfg, tokenizer)
    conversations = [{"messages": [{"role": "user", "content": f"Write it.\nSignature: {n}\nDocstring: d"}, {"role": "assistant", "content": n}]}
                     for n in names]
    sample, gen = embedded._image_batches(processor, conversations, cfg), torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def accuracy(batch) -> float:
        with torch.no_grad():
            features = model.get_image_features(pixel_values=batch["pixel_values"])
            features = torch.cat(list(getattr(features, "pooler_output", features)))
            picked = (features @ model.get_input_embeddings().weight.T).argmax(-1)
        cells = batch["cells"].reshape(-1)
        return float((picked == cells)[cells != -100].float().mean())

    held = sample(torch.Generator().manual_seed(1))
    before = accuracy(held)
    for _ in range(250):
        batch = sample(gen)
        embedded._reading_loss(model, batch["pixel_values"], batch["cells"]).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert before < 0.2 and accuracy(held) > 0.7


def test_stdlib_images_needs_the_image_text_target(tmp_path):
    with pytest.raises(RecipeError, match="target.embedded.vision"):
        micro_recipe(tmp_path, tmp_path / "t", "data.builtin=stdlib-images")
    with pytest.raises(RecipeError, match="data.builtin='stdlib-code'"):
        micro_recipe(tmp_path, tmp_path / "t", "data.builtin=stdlib-code")


@pytest.fixture(scope="module")
def micro_vlm(tmp_path_factory):
    from draftsmith.targets.embedded import build_embedded_target
    tmp = tmp_path_factory.mktemp("vlm-demo")
    recipe = micro_recipe(tmp / "runs", tmp / "target", *MICRO_VLM)
    report = build_embedded_target(recipe, recipe.target.model, recipe.data.heldout_fraction)
    return recipe, report


def test_the_image_text_demo_target_is_a_llava_model_reading_one_token_a_patch(micro_vlm):
    from draftsmith.targets import code_images
    from draftsmith.targets.loading import load_processor, load_target, load_tokenizer
    recipe, report = micro_vlm
    config = json.loads(open(f"{recipe.target.model}/config.json").read())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]
    assert set(report["image_reading"]) == {"prompts", "char_accuracy", "first_line_exact", "distinct_first_lines"}
    assert 0 <= report["image_reading"]["char_accuracy"] <= 1 and report["train_steps"] == 8
    processor = load_processor(recipe.target.model)
    tokenizer = load_tokenizer(recipe)
    vision = recipe.target.embedded.vision
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                                           tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[code_images.render("def f(x)", vision, tokenizer)], return_tensors="pt", add_special_tokens=False)
    assert int((inputs["input_ids"] == processor.draftsmith_image_token_id).sum()) == vision.grid ** 2
    model = load_target(recipe, torch.device("cpu"))
    with torch.no_grad():
        with_image = model(**inputs).logits[0, -1]
        blank = dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))
        assert not torch.allclose(with_image, model(**blank).logits[0, -1])  # the answer depends on the image


@pytest.mark.long
def test_the_image_text_demo_runs_end_to_end_with_tau_for_image_and_text_prompts(micro_vlm):
    """data (the target answers image conversations with their images, batched) -> capture -> train -> validate:
    exact against `generate` on image and text prompts, tau reported for each."""
    from draftsmith import stages
    from draftsmith.data.prepare import load_train
    recipe, _ = micro_vlm
    recipe = micro_recipe(recipe.out_dir, recipe.target.model, *MICRO_VLM, "data.regen.enabled=true",
                          "data.regen.max_new_tokens=12", "data.regen.batch_size=16", "validate.num_prompts=6",
                          "validate.max_new_tokens=12", "capture.layer_ids=[1, 4, 7]")
    for stage in ("data", "capture", "train"):
        stages.STAGE_FUNCS[stage](recipe)
    dataset, _ = load_train(recipe)
    image_token = json.loads(open(f"{recipe.target.model}/config.json").read())["image_token_index"]
    rows = [r for r in dataset if image_token in r["input_ids"]]
    assert rows and all(not any(m for t, m in zip(r["input_ids"], r["loss_mask"]) if t == image_token) for r in rows)
    from draftsmith.runtime.validate import run_validate
    summary = run_validate(recipe)
    result = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    assert summary["exact_match"] and result["exact_vs_generate"] and set(result["per_domain"]) == {"image", "text"}
