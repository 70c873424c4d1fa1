"""Train a draft head from Python: a recipe is a dataclass tree, and each stage is one function call.

    python examples/train_head.py [RECIPE] [key=value ...]
    python examples/train_head.py recipes/demo/stdlib-code-eagle3.yaml train.max_steps=50

Every stage writes a manifest and checks the previous one, so a second run skips what is done."""
import json
import sys

from draftsmith import recipe as recipes
from draftsmith.data.capture import run_capture
from draftsmith.data.prepare import run_data
from draftsmith.heads.registry import capture_needs
from draftsmith.runtime.validate import run_validate
from draftsmith.stages import is_current
from draftsmith.targets.embedded import build_embedded_target
from draftsmith.train.run import run_train


def main(argv: list[str]) -> None:
    path = argv[0] if argv and "=" not in argv[0] else "recipes/demo/stdlib-code-eagle3.yaml"
    recipe = recipes.load(path, [a for a in argv if "=" in a])
    recipe.run_dir.mkdir(parents=True, exist_ok=True)
    if recipe.target.embedded is not None and not is_current("target", recipe):
        build_embedded_target(recipe, recipe.target.model, recipe.data.heldout_fraction)
    if not is_current("data", recipe):
        print("data:", run_data(recipe))
    if not is_current("capture", recipe):
        run_capture(recipe, capture_needs(recipe.head.kind))
    if not is_current("train", recipe):
        run_train(recipe)
    summary = run_validate(recipe)
    report = json.loads((recipe.run_dir / "validate" / "validation.json").read_text())
    print(f"{recipe.head.kind} head for {recipe.target.model}: tau {summary['tau']:.2f}, "
          f"acceptance by depth {[round(a, 2) for a in report['acceptance_per_depth']]}, "
          f"exact against generate: {report['exact_vs_generate']}, head in {recipe.run_dir / 'head'}")


if __name__ == "__main__":
    main(sys.argv[1:])
