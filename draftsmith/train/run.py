"""The train stage: wire data, features, vocabulary and head into the one Trainer."""
from __future__ import annotations

from draftsmith import artifacts
from draftsmith.data.capture import capture_dir, layer_ids_for
from draftsmith.data.prepare import load_train
from draftsmith.data.vocab import load_or_build
from draftsmith.heads.registry import head_spec
from draftsmith.recipe import Recipe
from draftsmith.targets.features import FeatureCompleter
from draftsmith.targets.loading import load_target, load_target_embeddings, load_target_layers, load_tokenizer, target_fingerprint
from draftsmith.train import batches as B
from draftsmith.train.tracking import make_tracker
from draftsmith.train.trainer import Trainer, head_dir, make_accelerator, train_dir, train_inputs_hash


def _sources(recipe: Recipe, dataset, data_manifest: dict, layer_ids: list[int], accelerator):
    """(feature source, input embedding, lm_head, completer or None) for offline or online mode."""
    if recipe.capture.mode == "online":  # a sharded target (target.parallel) runs on every rank of its replica
        from draftsmith.targets.parallel import full, layout_for
        model = load_target(recipe, accelerator.device, layout_for(recipe, "train"), "train")
        tokenizer = load_tokenizer(recipe) if "images" in dataset.column_names else None  # carries the processor
        return (B.OnlineSource(model, layer_ids, dataset, tokenizer), full(model.get_input_embeddings().weight.detach()),
                full(model.get_output_embeddings().weight.detach()), None)
    from draftsmith.data.store import CaptureStore
    expected = {"target_id": recipe.target.model, "target_fingerprint": target_fingerprint(recipe.target.model),
                "layer_ids": layer_ids, "head_kind": recipe.head.kind, "data_hash": data_manifest["inputs_hash"]}
    store = CaptureStore(capture_dir(recipe), expected=expected)
    if len(store) != len(dataset):
        raise artifacts.ArtifactError(f"{capture_dir(recipe)} holds {len(store)} samples, the data stage {len(dataset)}")
    if store.manifest.get("recompute"):  # a compact store: rebuild the low feature and the teacher on the device
        model = load_target_layers(recipe, accelerator.device, skip=range(layer_ids[0], layer_ids[-1]))
        return (B.OfflineSource(store, recipe.train.corrupt_samples), model.get_input_embeddings().weight,
                model.get_output_embeddings().weight, FeatureCompleter(model, layer_ids))
    embed, lm_head = load_target_embeddings(recipe.target.model)
    return B.OfflineSource(store, recipe.train.corrupt_samples), embed, lm_head, None


def _init_from(head, path: str, target_config, d2t, t2d):
    """Start from a published or exported head of the same kind (`head.init_from`): its trained
    tensors replace the fresh ones (its draft vocabulary too, where the kind has one)."""
    from draftsmith.heads.loading import load_head
    start, meta = load_head(path, target_config)
    if start.kind != head.kind:
        raise ValueError(f"head.init_from={path!r} is a {start.kind} head; the recipe trains head.kind={head.kind}")
    ours, theirs = head.trainable_state(), start.trainable_state()
    wrong = [k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape]
    if wrong:
        raise ValueError(f"head.init_from={path!r}: tensors {wrong[:4]} are missing or of another shape than this "
                         f"recipe's {head.kind} head for {getattr(target_config, 'name_or_path', 'the target')}")
    head.load_state_dict(theirs, strict=False)
    print(f"head initialized from {path} ({meta.get('source_format')})", flush=True)
    state = head.state_dict()
    return (state["d2t"], state["t2d"]) if "d2t" in state else (d2t, t2d)


def _joint(recipe: Recipe, dataset, head, accelerator, total_steps: int, target_config, layout):
    """Medusa-2 / joint MTP: the target with LoRA adapters and the head, as one trained module. A
    tensor-parallel target gets tensor-parallel adapters (peft), trained by the ranks of one replica."""
    from draftsmith.targets.lora import attach_lora, check_sharded_lora
    from draftsmith.targets.parallel import full
    from draftsmith.train.joint import JointModel, heads_only_steps
    heads_only_steps(recipe.head.lora, total_steps)  # refused before the target loads
    check_sharded_lora(recipe.head.lora, target_config, layout)
    if recipe.capture.mode != "online":
        raise ValueError(f"head.lora is set (joint training of head and target): set capture.mode: online "
                         f"(got {recipe.capture.mode!r}); the target's features change as it trains")
    model = load_target(recipe, accelerator.device, layout, "train")
    embed, lm_head = full(model.get_input_embeddings().weight.detach()), full(model.get_output_embeddings().weight.detach())
    head.load_target_weights(embed, lm_head)
    joint = JointModel(attach_lora(model, recipe.head.lora, recipe.train.seed), head, recipe.head.lora, total_steps)
    return B.TokenSource(dataset), joint, lm_head


def _planned_steps(recipe: Recipe, num_samples: int, world: int) -> int:
    import math
    per_epoch = len(B.epoch_order(num_samples, recipe.train.seed, 0, 0, world, recipe.train.batch_size))
    return max(1, recipe.train.max_steps or math.ceil(recipe.train.epochs * per_epoch / recipe.train.grad_accum))


def build_trainer(recipe: Recipe, accelerator=None) -> Trainer:
    from draftsmith.targets.loading import local_model, target_config as read_config
    from draftsmith.targets.parallel import layout_for
    layout = layout_for(recipe, "train")
    accelerator = accelerator or make_accelerator(recipe)
    dataset, data_manifest = load_train(recipe)
    target_config = read_config(local_model(recipe.target.model, recipe.target.dtype))
    text_config = target_config.get_text_config()
    spec = head_spec(recipe.head.kind)
    layer_ids = layer_ids_for(recipe, text_config.num_hidden_layers, spec.features)
    head = spec.model.from_target(target_config, recipe.head, layer_ids)
    head.objective = (recipe.head.objective, recipe.head.lk_scale, recipe.head.lk_rate)
    head.checkpoint_steps = recipe.train.activation_checkpointing
    if isinstance(head.config.get("draftsmith"), dict):  # the position range it learns, carried into its exports
        head.config["draftsmith"]["trained_max_tokens"] = min(recipe.data.max_length, recipe.train.max_batch_tokens)
        head.config["draftsmith"]["objective"] = recipe.head.objective
    if recipe.head.lora is not None:
        train_idx, _ = B.split_indices(len(dataset))
        source, joint, lm_head = _joint(recipe, dataset, head, accelerator,
                                        _planned_steps(recipe, len(train_idx), layout.dp), target_config, layout)
        return _assemble(recipe, joint, source, None, lm_head, accelerator, text_config.vocab_size,
                         {"draft_vocab_size": text_config.vocab_size, "coverage": 1.0})
    source, embed, lm_head, completer = _sources(recipe, dataset, data_manifest, layer_ids, accelerator)
    draft_vocab = head.config.get("draft_vocab_size") or text_config.vocab_size  # none: the full vocabulary
    d2t, t2d, vocab_report = load_or_build(recipe.run_dir / "cache", data_manifest["inputs_hash"], dataset,
                                           text_config.vocab_size, draft_vocab)
    head.set_vocab(d2t, t2d)
    if recipe.head.init_from:
        d2t, t2d = _init_from(head, recipe.head.init_from, target_config, d2t, t2d)
        vocab_report = {**vocab_report, "from": recipe.head.init_from}
    head.lm_head_from_target = recipe.head.lm_head_init == "target" and not recipe.head.init_from
    head.load_target_weights(embed, lm_head)
    return _assemble(recipe, head, source, completer, lm_head, accelerator, d2t, vocab_report, t2d)


def _assemble(recipe: Recipe, head, source, completer, lm_head, accelerator, d2t, vocab_report, t2d=None) -> Trainer:
    import torch
    if t2d is None:  # the full vocabulary: identity maps
        d2t, t2d = torch.zeros(d2t, dtype=torch.long), torch.ones(d2t, dtype=torch.bool)
    train_idx, eval_idx = B.split_indices(len(source))
    train_dir(recipe).mkdir(parents=True, exist_ok=True)
    tracker = make_tracker(recipe, train_dir(recipe), accelerator.is_main_process)
    trainer = Trainer(recipe, head, B.Subset(source, train_idx), B.Subset(source, eval_idx) if eval_idx else None,
                      d2t, t2d, lm_head, accelerator, tracker, completer)
    trainer.vocab_report = vocab_report
    if accelerator.is_main_process:
        print(f"draft vocabulary: {vocab_report['draft_vocab_size']} ids cover "
              f"{vocab_report['coverage']:.1%} of training target tokens", flush=True)
    return trainer


def run_train(recipe: Recipe) -> dict:
    """Train (resuming from the last complete checkpoint), then write <run>/head/ and the manifest."""
    trainer = build_trainer(recipe)
    trainer.resume()
    final = trainer.run()
    tensors = trainer.head_tensors()
    manifest = {}
    write_extra = None
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(unwrapped, "split_state"):  # joint: the head's tensors, and the LoRA adapter in head/lora/
        from draftsmith.targets.lora import save_adapter
        tensors, adapter = unwrapped.split_state(tensors)
        write_extra = lambda directory: save_adapter(unwrapped.target, adapter, directory / "lora")  # noqa: E731
    if trainer.accelerator.is_main_process:
        meta = trainer.metadata() | {"vocab": trainer.vocab_report, "final_metrics": final}
        artifacts.save_checkpoint(head_dir(recipe), tensors, meta, write_extra)
        manifest = artifacts.write_manifest(head_dir(recipe), "train", train_inputs_hash(recipe),
                                            target_id=recipe.target.model, steps=trainer.step, tokens=trainer.tokens,
                                            final_metrics=final, vocab=trainer.vocab_report)
    trainer.tracker.finish()
    trainer.accelerator.wait_for_everyone()
    return manifest
