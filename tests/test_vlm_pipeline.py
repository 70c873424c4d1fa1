"""Image-text targets end to end (issue #52): tiny random LLaVA (CLIP vision tower, Llama language model) and Gemma 3
(SigLIP tower, sliding layers, image tokens attending to each other both ways in the prefill) models with
their own processors, built offline; image conversations drawn with PIL. Data (the processor expands each
image into its tokens, never under the loss mask), capture (pixel inputs; features at every position equal the
model's own forward), training, and validation on image and text prompts, exact against `generate`."""
import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import micro_recipe, write_jsonl


def _template(image: str, assistant: str = "assistant") -> str:
    return ("{% for m in messages %}<|im_start|>{{ '" + assistant + "' if m['role'] == 'assistant' else m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>" + assistant + "\n{% endif %}")


def _tokenizer(image_tokens: dict):
    """A byte-level BPE with the chat tokens and the family's image tokens (name -> token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>", *image_tokens.values()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    corpus = ["user assistant model What number is drawn? The image shows the number", "def add(a, b): return a + b\n",
              " ".join(str(i) for i in range(100))]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=360, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   extra_special_tokens=image_tokens)


def _text(tokenizer, **kwargs) -> dict:
    ids = tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "<|im_end|>"])
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=ids[0], bos_token_id=ids[1],
                eos_token_id=ids[2], **kwargs)


def _save(model, processor, tokenizer, out_dir):
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)


def build_tiny_llava(out_dir) -> tuple[int, int]:
    """A LLaVA processor (PIL image processor) and a random LlavaForConditionalGeneration (CLIP tower, Llama), saved as
    a hub model directory is; returns (image token id, image tokens per image)."""
    from transformers import AutoModelForImageTextToText, LlavaConfig, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    tokenizer = _tokenizer({"image_token": "<image>"})
    template = _template("<image>\n")
    tokenizer.chat_template = template
    processor = LlavaProcessor(image_processor=LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, chat_template=template, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    config = LlavaConfig(text_config=dict(model_type="llama", **_text(tokenizer)),
                         vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                                            projection_dim=32),
                         image_token_index=tokenizer.image_token_id, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    _save(AutoModelForImageTextToText.from_config(config), processor, tokenizer, out_dir)
    return tokenizer.image_token_id, 16  # (32 / 8)^2 patches (the CLS token is dropped: "default" selection)


def build_tiny_gemma3(out_dir) -> tuple[int, int]:
    """A Gemma 3 processor (PIL image processor) and a random Gemma3ForConditionalGeneration (SigLIP tower, sliding and
    full layers; image tokens attend to each other both ways in the prefill)."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    tokenizer = _tokenizer({"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"})
    template = _template("<start_of_image>", assistant="model")
    tokenizer.chat_template = template
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
                                tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    config = Gemma3Config(text_config=_text(tokenizer, head_dim=16, sliding_window=8),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                             image_size=32, patch_size=8),
                          mm_tokens_per_image=4, image_token_index=tokenizer.image_token_id,
                          boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
                          eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"))
    torch.manual_seed(0)
    _save(AutoModelForImageTextToText.from_config(config), processor, tokenizer, out_dir)
    return tokenizer.image_token_id, 4


FAMILIES = {"llava": build_tiny_llava, "gemma3": build_tiny_gemma3}


def _conversations(tmp_path, n: int = 40) -> list:
    records = []
    for i in range(n):
        if i % 2:
            image = Image.new("RGB", (40 + i, 32), (255, 255 - 5 * i, 255))
            ImageDraw.Draw(image).text((4, 8), str(i), fill="black")
            image.save(tmp_path / f"img{i}.png")
            user = [{"type": "image_url", "image_url": {"url": f"img{i}.png"}}, {"type": "text", "text": "What number is drawn?"}]
            records.append({"id": f"i{i}", "messages": [{"role": "user", "content": user},
                                                        {"role": "assistant", "content": f"The image shows the number {i}"}]})
        else:
            records.append({"id": f"t{i}", "messages": [{"role": "user", "content": f"def add{i}(a, b):"},
                                                        {"role": "assistant", "content": "return a + b"}]})
    return records


@pytest.fixture(scope="module", params=["llava", pytest.param("gemma3", marks=pytest.mark.long)])
def vlm_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    image_token, per_image = FAMILIES[request.param](tmp / "target")
    data = write_jsonl(tmp / "conversations.jsonl", _conversations(tmp))
    recipe = micro_recipe(tmp / "runs", tmp / "target", "data.builtin=null", f'data.sources=[{{path: "{data}"}}]',
                          "data.heldout_fraction=0.3", "head.draft_vocab_size=128", "capture.layer_ids=[1, 2, 3]",
                          "validate.num_prompts=6", "validate.max_new_tokens=12", "train.max_steps=6")
    return recipe, image_token, per_image


def _trained(recipe):
    """The pipeline's stages up to the head, each run unless current (a test picked alone still has its head)."""
    from draftsmith import stages
    for stage in ("data", "capture", "train"):
        if not stages.is_current(stage, recipe):
            stages.STAGE_FUNCS[stage](recipe)
    return recipe


def test_image_conversations_are_expanded_by_the_processor_and_never_under_the_loss_mask(vlm_run):
    from draftsmith.data.prepare import load_train, run_data
    recipe, image_token, per_image = vlm_run
    manifest = run_data(recipe)
    dataset, _ = load_train(recipe)
    assert "images" in dataset.column_names and manifest["num_skipped"].get("bad_image", 0) == 0
    from draftsmith.targets.loading import load_tokenizer
    tokenizer = load_tokenizer(recipe)
    for row in dataset:
        ids, mask = row["input_ids"], row["loss_mask"]
        image_positions = [i for i, t in enumerate(ids) if t == image_token]
        assert len(image_positions) == per_image * len(row["images"])
        assert all(mask[i] == 0 for i in image_positions)
        answered = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        expected = "The image shows the number" if row["images"] else "return a + b"
        assert answered.startswith(expected) and answered.endswith("<|im_end|>")


def test_capture_runs_the_images_and_stores_the_models_own_features(vlm_run):
    from draftsmith.data.capture import capture_dir, run_capture
    from draftsmith.data.prepare import load_train
    from draftsmith.data.store import CaptureStore
    from draftsmith.heads.registry import capture_needs
    from draftsmith.targets.loading import load_target, load_tokenizer
    recipe, image_token, _ = vlm_run
    manifest = run_capture(recipe, capture_needs(recipe.head.kind))
    assert manifest["recompute"] is False and "image_processor" in manifest
    dataset, _ = load_train(recipe)
    row = next(i for i, images in enumerate(dataset["images"]) if images)
    model, tokenizer = load_target(recipe, torch.device("cpu")), load_tokenizer(recipe)
    from draftsmith.data.images import pixel_inputs
    ids = torch.tensor([dataset[row]["input_ids"]])
    with torch.no_grad():
        hidden = model(input_ids=ids, **pixel_inputs(tokenizer, [dataset[row]["images"]], "test", ids),
                       output_hidden_states=True).hidden_states
    stored = CaptureStore(capture_dir(recipe))[row]
    expected = torch.cat([hidden[k][0] for k in (1, 2, 3)], -1)
    kept = len(stored["aux"])  # up to the last position a loss reads (records.needed_length)
    assert kept > max(i for i, t in enumerate(dataset[row]["input_ids"]) if t == image_token)
    torch.testing.assert_close(stored["aux"].float(), expected[:kept], atol=0.05, rtol=0.02)  # the store is bf16


def test_head_trains_and_validates_exactly_on_image_and_text_prompts(vlm_run, tmp_path):
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.run import run_train
    recipe, _, _ = vlm_run
    run_train(recipe)
    summary = run_validate(recipe, out=str(tmp_path / "v"))
    result = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert summary["exact_match"] and result["exact_vs_generate"], result["mismatched_prompts_vs_generate"]
    assert set(result["per_domain"]) == {"image", "text"}


def test_prefill_with_images_equals_the_models_own_forward(vlm_run):
    from draftsmith.data.images import pixel_inputs
    from draftsmith.runtime.target import TargetRunner
    from draftsmith.targets.loading import load_target, load_tokenizer
    recipe, _, _ = vlm_run
    model, tokenizer = load_target(recipe, torch.device("cpu")), load_tokenizer(recipe)
    image = sorted(Path(recipe.data.sources[0].path).parent.glob("img*.png"))[0]
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": "What number is drawn?"}]}]
    inputs = tokenizer.draftsmith_processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                                add_generation_prompt=True, return_tensors="pt")
    runner = TargetRunner(model, 128, [1, 3], compile_mode=None)
    logits, _, _ = runner.prefill(inputs["input_ids"][0], pixel_inputs(tokenizer, [[str(image)]], "test", inputs["input_ids"]))
    with torch.no_grad():
        reference = model(**inputs).logits[0]
    torch.testing.assert_close(logits, reference[-1:].float(), atol=1e-4, rtol=1e-4)  # the prefill's last position
    runner.reset()
    text_only, _, _ = runner.prefill(inputs["input_ids"][0])
    assert not torch.allclose(text_only[-1], reference[-1].float(), atol=1e-3)  # the images matter


def test_exports_serve_the_head_on_the_language_model_and_validate_back_exactly(vlm_run, tmp_path):
    """vLLM, SGLang and speculators exports of a head trained on an image-text target: a Llama draft on plain 1D
    positions (no mrope section: the image reaches it through the target's features, as vLLM serves VLM heads),
    sized from the language model; speculators names the verifier as published. The vLLM export validates back
    exactly on image and text prompts."""
    from draftsmith.runtime.export import export_head
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.trainer import head_dir
    recipe = _trained(vlm_run[0])
    run_validate(recipe)  # validated where export looks
    target = json.loads((Path(recipe.target.model) / "config.json").read_text())
    for engine in ("vllm", "sglang", "speculators"):
        export_head(str(head_dir(recipe)), engine, str(tmp_path / engine))
        config = json.loads((tmp_path / engine / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert layer["hidden_size"] == target["text_config"]["hidden_size"] and not layer.get("rope_scaling")
        assert "mrope_section" not in json.dumps(config)
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    speculators = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert speculators["speculators_config"]["verifier"]["architectures"] == target["architectures"]
    summary = run_validate(recipe, head=str(tmp_path / "vllm"), out=str(tmp_path / "v"))
    result = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert summary["exact_match"] and result["exact_vs_generate"] and set(result["per_domain"]) == {"image", "text"}


def test_image_prompts_are_answered_by_the_target_with_their_images(vlm_run, tmp_path):
    """Regeneration in process: an image prompt's answer is what the model's own `generate` says given the image
    (its processor's inputs), and it is trained on like any answer."""
    from draftsmith.data.prepare import load_train, run_data
    from draftsmith.targets.loading import load_target, load_tokenizer
    recipe, image_token, _ = vlm_run
    image = sorted(Path(recipe.data.sources[0].path).parent.glob("img*.png"))[1]
    user = [{"type": "image", "image": str(image)}, {"type": "text", "text": "What number is drawn?"}]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": f"q{i}", "messages": [{"role": "user", "content": user}]}
                                                       for i in range(3)] + [{"id": "t", "prompt": "def add(a, b):"}])
    answering = micro_recipe(tmp_path / "runs", recipe.target.model, "data.builtin=null", f'data.sources=[{{path: "{prompts}"}}]',
                             "data.heldout_fraction=0", "data.regen.enabled=true", "data.regen.max_new_tokens=6",
                             "data.regen.batch_size=4")
    manifest = run_data(answering)
    assert manifest["regeneration"]["regenerated"] == 4 and manifest["num_train_conversations"] == 4
    model, tokenizer = load_target(answering, torch.device("cpu")), load_tokenizer(answering)
    inputs = tokenizer.draftsmith_processor.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                                                return_dict=True, add_generation_prompt=True, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    regenerated = [json.loads(line) for line in (Path(answering.run_dir) / "data").glob("regen-*.jsonl").__next__().read_text().splitlines()]
    answers = {r["id"]: r["messages"][-1]["content"] for r in regenerated}
    assert answers["q0"] == answers["q1"] == expected
    dataset, _ = load_train(answering)
    row = dataset[dataset["id"].index("q0")]
    assert image_token in row["input_ids"] and sum(row["loss_mask"]) > 0


def test_check_decodes_image_prompts_with_their_images(vlm_run, tmp_path):
    """`check` on the export of a head trained on an image-text target: the served decoding reads each image prompt's
    images, so its outputs equal the validation record's (no false `outputs` or `tau` finding)."""
    from draftsmith.runtime.check import run_check
    from draftsmith.runtime.export import export_head
    from draftsmith.runtime.validate import run_validate
    from draftsmith.train.trainer import head_dir
    recipe = _trained(vlm_run[0])
    run_validate(recipe)
    export_head(str(head_dir(recipe)), "vllm", str(tmp_path / "vllm"))
    result = run_check(str(tmp_path / "vllm"))  # the export's own record carries the recipe
    assert result["findings"] == [] and result["decoding"]["num_prompts"] == recipe.validate.num_prompts


@pytest.mark.long
@pytest.mark.parametrize("kind", ["dflash", "eagle2"])
def test_other_head_kinds_validate_exactly_on_image_prompts(vlm_run, tmp_path, kind):
    """A block drafter (DFlash) and a head fed the final hidden state (EAGLE-2) on the same image data: the runtime's
    image prefill serves every drafter, exact against `generate`."""
    from draftsmith import stages
    from draftsmith.runtime.validate import run_validate
    recipe, _, _ = vlm_run
    extra = (["head.kind=dflash", "head.block_size=4", "head.num_layers=1", "head.num_anchors=4", "validate.top_k=1"]
             if kind == "dflash" else ["head.kind=eagle2", "capture.layer_ids=null"])
    other = micro_recipe(tmp_path / "runs", recipe.target.model, "data.builtin=null",
                         f'data.sources=[{{path: "{recipe.data.sources[0].path}"}}]', "data.heldout_fraction=0.3",
                         "head.draft_vocab_size=128", "validate.num_prompts=6", "validate.max_new_tokens=12",
                         "train.max_steps=4", *extra)
    for stage in ("data", "capture", "train"):
        stages.STAGE_FUNCS[stage](other)
    summary = run_validate(other, out=str(tmp_path / "v"))
    result = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert summary["exact_match"] and result["exact_vs_generate"] and set(result["per_domain"]) == {"image", "text"}
