"""Image conversations (issue #52, data): every shape becomes OpenAI image parts, each image is read once and
checked, and a bad one is named (and skipped under bad_lines: skip)."""
import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from conftest import micro_recipe, write_jsonl
from draftsmith.data import images
from draftsmith.data.conversations import DataError, SkipCounter, normalize
from draftsmith.data.prepare import collect


def _png(path: Path, text: str = "def f(x):") -> Path:
    image = Image.new("RGB", (64, 32), "white")
    ImageDraw.Draw(image).text((2, 8), text, fill="black")
    image.save(path)
    return path


def test_every_shape_becomes_image_parts(tmp_path):
    png = _png(tmp_path / "code.png")
    data_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    for source in (str(png), f"file://{png}", data_url):
        record = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": source}},
                                                           {"type": "text", "text": "Continue the code."}]},
                               {"role": "assistant", "content": "    return x"}]}
        user = normalize(record, "f.jsonl:1")["messages"][0]["content"]
        assert user[0]["type"] == "image" and user[1] == {"type": "text", "text": "Continue the code."}
        assert images.load_image(user[0]["image"], "f.jsonl:1").size == (64, 32)
    relative = {"messages": [{"role": "user", "content": [{"type": "image", "path": "code.png"}]},
                             {"role": "assistant", "content": "ok"}]}
    assert normalize(relative, "f:1", base_dir=tmp_path)["messages"][0]["content"][0]["image"] == str(png)
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert normalize(text_only, "f:1")["messages"][0]["content"] == "ab"


def test_llava_markers_take_the_records_images_in_order(tmp_path):
    _png(tmp_path / "a.png"), _png(tmp_path / "b.png")
    record = {"id": "s1", "image": ["a.png", "b.png"], "conversations": [
        {"from": "human", "value": "<image>\nWhat does this do?"}, {"from": "gpt", "value": "It adds."},
        {"from": "human", "value": "And this? <image>"}, {"from": "gpt", "value": "It subtracts."}]}
    turns = normalize(record, "llava.json[0]", base_dir=tmp_path)["messages"]
    assert turns[0]["content"] == [{"type": "image", "image": str(tmp_path / "a.png")},
                                   {"type": "text", "text": "What does this do?"}]
    assert turns[2]["content"] == [{"type": "text", "text": "And this? "}, {"type": "image", "image": str(tmp_path / "b.png")}]
    assert images.images_of(turns) == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    unmarked = {"image": "a.png", "conversations": [{"from": "human", "value": "Describe."}, {"from": "gpt", "value": "x"}]}
    assert normalize(unmarked, "w", base_dir=tmp_path)["messages"][0]["content"][0]["type"] == "image"
    with pytest.raises(DataError, match=r"llava.json\[1\]: 2 <image> marker\(s\) for 1 image"):
        normalize({**record, "image": "a.png"}, "llava.json[1]", base_dir=tmp_path)


@pytest.mark.parametrize("damage, message", [
    ("missing", "does not exist"), ("corrupt", "cannot be read"), ("truncated", "cannot be read"), ("remote", "not fetched")])
def test_bad_images_are_named(tmp_path, damage, message):
    png = _png(tmp_path / "x.png")
    source = {"missing": str(tmp_path / "nope.png"), "remote": "https://example.com/x.png"}.get(damage, str(png))
    if damage == "corrupt":
        png.write_bytes(b"not an image at all")
    if damage == "truncated":
        png.write_bytes(png.read_bytes()[:60])
    with pytest.raises(images.ImageError, match=rf"rec:7: image .*{message}"):
        images.load_image(source, "rec:7")


def test_data_stage_skips_bad_images_and_says_what_image_conversations_need(tmp_path):
    good, bad = _png(tmp_path / "good.png"), tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG broken")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": "Go"}]},
                          {"role": "assistant", "content": "ok"}]} for name in ("bad.png",)]
    text = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows + text)
    recipe = micro_recipe(tmp_path, tmp_path / "target", f'data.sources=[{{path: "{path}"}}]', "data.bad_lines=skip", "data.builtin=null")
    skips = SkipCounter()
    train, heldout, num_read = collect(recipe, skips)
    assert skips.reasons["bad_image"] == 1 and skips.examples["bad_image"] == f"{path}:1" and len(train) + len(heldout) == 1
    strict = micro_recipe(tmp_path, tmp_path / "target", f'data.sources=[{{path: "{path}"}}]', "data.bad_lines=fail", "data.builtin=null")
    with pytest.raises(DataError, match=rf"{path}:1: image .*bad.png cannot be read"):
        collect(strict, SkipCounter())
    path.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "image", "image": good.name}]},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    with pytest.raises(DataError, match="holds images.*reads text only.*image-text model"):
        collect(recipe, SkipCounter())


def test_a_processor_giving_inputs_draftsmith_does_not_carry_is_refused_by_name(tmp_path):
    """A processor whose output holds per-token inputs other than token types marking the image tokens (PaliGemma's
    prefix/suffix types, for one) would be captured and decoded without them: refused, naming the processor and key."""
    from types import SimpleNamespace
    from draftsmith.data.images import expand

    class Processor:
        draftsmith_image_token_id = 9

        def __call__(self, text, images, add_special_tokens):
            return {"input_ids": [[1, 9, 9, 2]], "attention_mask": [[1] * 4], "token_type_ids": [[0, 0, 1, 1]]}

    tokenizer = SimpleNamespace(draftsmith_processor=Processor())
    image = _png(tmp_path / "a.png")
    with pytest.raises(ValueError, match=r"rec1: Processor also gives \['token_type_ids \(other than 1 on the image tokens\)'\]"):
        expand(tokenizer, "x", [1, 5, 2], [0, 0, 1], [str(image)], "rec1")
    text_only = SimpleNamespace(draftsmith_processor=None)
    with pytest.raises(ValueError, match="rec2: the conversation holds images and the target reads text only"):
        expand(text_only, "x", [1, 5, 2], [0, 0, 1], [str(image)], "rec2")
