"""Images of stdlib source for the image-text demo target (issue #52): the start of a function (its signature and
the first line of its docstring) drawn one character a patch on a grid, and the conversations that ask the target
to write the function the image begins.

One character a patch keeps reading learnable on a CPU budget: a patch holds one whole glyph at one place, so the
tower's patch embedding sees each character alone. The images travel inside the conversations as PNG data URLs,
so a dataset of them needs no files beside it."""
from __future__ import annotations

import base64
import hashlib
import io

from draftsmith.recipe import EmbeddedVisionConfig

IMAGE_TOKEN = "<image>"  # LLaVA's placeholder, expanded by the processor into grid x grid image tokens
IMAGE_PROMPT = "Write the function this image begins."


def image_size(cfg: EmbeddedVisionConfig) -> int:
    return cfg.grid * cfg.patch_size


def render(text: str, cfg: EmbeddedVisionConfig):
    """`text` drawn black on white, one character a grid cell, row by row (a newline starts a row); what does not
    fit is cut."""
    from PIL import Image, ImageDraw, ImageFont
    size, cell = image_size(cfg), cfg.patch_size
    image = Image.new("RGB", (size, size), "white")
    draw, font = ImageDraw.Draw(image), ImageFont.load_default(size=cell - 1)
    row = col = 0
    for char in text:
        if char == "\n" or col == cfg.grid:
            row, col = row + 1, 0
            if char == "\n":
                continue
        if row == cfg.grid:
            break
        draw.text((col * cell + cell // 2, row * cell + cell // 2), char, fill="black", font=font, anchor="mm")
        col += 1
    return image


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def drawn_text(conversation: dict) -> str:
    """What the image of a function conversation shows: the signature, then the docstring's first line."""
    prompt = conversation["messages"][0]["content"]
    fields = dict(line.split(": ", 1) for line in prompt.splitlines()[1:] if ": " in line)
    return f"{fields.get('Signature', '')}\n{fields.get('Docstring', '')}"


def as_image_conversation(conversation: dict, cfg: EmbeddedVisionConfig) -> dict:
    """The same function asked with its start in an image instead of in words."""
    image = data_url(render(drawn_text(conversation), cfg))
    user = [{"type": "image", "image": image}, {"type": "text", "text": IMAGE_PROMPT}]
    return {"id": conversation["id"] + ":image", "messages": [{"role": "user", "content": user}, *conversation["messages"][1:]]}


def is_image_item(conversation_id: str) -> bool:
    """`data.builtin: stdlib-images`: half the functions, fixed by their id, are asked with an image (the same split on every machine)."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:8], 16) % 2 == 0

