"""GRPO training speed: Twinkle Flows' GRPO recipe against trl's GRPOTrainer, each in its own process.

    python bench/bench_grpo.py                                 # 6 steps (the first one not measured), 2 repeats
    python bench/bench_grpo.py --steps 3 --repeats 1           # a quick check that both sides run
    python bench/bench_grpo.py --num-generations 8 --max-completion-length 32 --trainers ours

Both sides run the grpo flow's offline default (flows/grpo.py), written once by this script as the flow writes
it: `GRPOConfig(...).run_config(...)`, the very `TrainRunConfig` file the flow hands its workers; the trl worker
reads its settings from that same file. The model is SmolLM2-135M-Instruct (`--model-id`, the GGUF converted
once into a cached HF folder that both sides load); the prompts are twinkle_core/datasets/arithmetic/train.jsonl
("What is 8 + 11? Reply with the sum only.", a `solution` field), rendered with the model's own chat template
(a single user turn after its default system prompt: the same prompt token ids on both sides, checked),
`--batch-size` 8 prompts per step in our seeded order (seed 42) on both sides, `--num-generations` 4 completions
each (32 sequences a step), at most `--max-completion-length` 16 new tokens, sampled with temperature 1.0,
top_p 1.0, no top-k, the KV cache on (plain `generate`, no vLLM, no continuous batching), stopping at any of the
model's end-of-sequence ids. Rewards: the project's own `numeric_match` (weight 1) and `format` (weight 0.5, the
flow's number-only pattern), twinkle_core/rl/rewards.py. Advantages (r - group mean) / (group std + 1e-4), the
PPO-clipped surrogate (epsilon 0.2) with the `grpo` loss (each completion's token mean), kl beta 0 (the flow's
default: no reference pass on either side), one iteration per rollout (no "old" log-prob pass on either side).
LoRA r=8, alpha 32, dropout 0 on every linear layer but the output layer, the frozen base stored in bf16 and the
adapter in fp32 under bf16 autocast (the flow's `mixed_precision="auto"` is bf16 on a CPU with AVX512-BF16 or
AMX, fp32 elsewhere; both sides follow it), fused AdamW at the flow's lr 3e-4, no weight decay, clip 1.0, a
constant schedule (the flow's cosine would make the last steps' updates vanish in so short a run), seed 42.

- `ours`: twinkle_core.train.grpo.GRPORecipe on that run config, in-process, as its worker runs it (setup,
  train; the checkpoint export is skipped). The recipe times each step itself: `rollout_s` (sampling with the
  policy's `generate`, decoding, scoring, advantages, batching) and `update_s` (forward_backward, clip and
  optimizer step); the worker reads them, with the reward and completion length, from its per-step metrics.
- `trl`: trl's `GRPOTrainer` on `AutoModelForCausalLM(the same folder, dtype=bf16)` with `peft_config=LoraConfig
  (the same)` and `GRPOConfig(per_device_train_batch_size=batch x generations (trl counts completions),
  gradient_accumulation_steps=1 (so steps_per_generation=1: it generates every step, for one optimizer step),
  num_generations, max_completion_length, temperature, top_p, top_k=0, learning_rate, lr_scheduler_type=
  "constant", optim="adamw_torch_fused", weight_decay=0, max_grad_norm=1.0, beta=0, epsilon=0.2, num_iterations=1,
  loss_type="grpo", scale_rewards="group", reward_weights=[1.0, 0.5], bf16, use_cpu, use_vllm=False,
  gradient_checkpointing=False (trl's default is True; ours has none), disable_dropout=True (as ours),
  shuffle_dataset=False, logging_steps=1, report_to="none", no saving)`, on a `datasets.Dataset` of the same
  prompts in the same order in trl's conversational layout (`{"prompt": [{"role": "user", "content": ...}],
  "solution": ...}`, so trl applies the same chat template). The reward functions are ours, each in a thin
  wrapper that hands them the text of trl's conversational prompts and completions (trl passes message lists
  in that layout; ours take strings) with the same options. A subclass times `_generate_and_score_completions`
  (rollout: tokenising the prompts, generate, decoding, scoring, advantages); a step callback times each
  optimizer step (on_step_begin to on_step_end), and update is the step less its rollout (the loss forward
  and backward, clip, optimizer and scheduler step).

Measured, per process, over the steps after the first (a warm-up: it also pays each side's first-call costs):
steps/s is the measured steps over the wall time from the end of the first step to the end of the last (all a
step costs, bookkeeping between steps included: trl's per-step logging and batch fetch, our metric and event
lines); rollout and update are the means per step of the times above, "other" what the wall time holds beyond
them. Model loading and setup come before the first step and are not counted. Peak RSS is each process's own
(VmHWM). Reward: the mean weighted reward of the 32 completions of the first and of the last step; completion
tokens: the mean length of the measured steps' completions (what sampling and the update cost grow with). The
two sides sample with their own generators, so their completions, rewards and lengths differ; the same prompts,
settings and seed make the runs comparable, not identical. Each worker runs with the allocator settings our
launcher gives CPU workers (twinkle_core.launch.cpu_allocator_env) and torch's default thread count; the runs
alternate ours / trl `--repeats` times, and the table prints medians over the repeats with the min-max spread.

Known differences: trl tokenises the prompts with the chat template inside each rollout (ours encoded them
once, before training); trl's `generate` runs outside autocast (Accelerate wraps the PeftModel's forward, which
generate does not call: bf16 base weights, the fp32 adapter as PEFT computes it) while ours generates under bf16
autocast; trl 1.16 scores the policy's log-probs with its fused chunked LM-head kernel (trl.kernels.
chunked_logprob), which off Triton devices (CPU here) projects every position of the batch, prompt and padding
included, where ours projects the completion tokens only; trl logs its metrics (gathered through Accelerate)
every step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: bench_sft, hf_clock

from bench_sft import DEFAULT_MODEL, RESULT, ROOT, peak_rss_mb  # noqa: E402  (bench_sft puts ROOT on sys.path)

TRAINERS = ("ours", "trl")


def prepare(args, work: Path) -> Path:
    """The grpo flow's run config for these settings, written as the flow writes it for its workers."""
    from flows.grpo import GRPOConfig
    from tasks.refs import ModelRef
    from twinkle_core.data import tokenize_dataset
    from twinkle_core.families import family_for_model_dir
    from twinkle_core.hub import resolve_dataset, resolve_model

    flow = GRPOConfig(model_id=args.model_id, batch_size=args.batch_size, num_generations=args.num_generations,
                      max_completion_length=args.max_completion_length, max_steps=args.steps,
                      scheduler="ConstantWarmupScheduler", warmup_ratio=0.0, checkpoint_every=None)
    resolved = resolve_model(flow.model_id)
    family = family_for_model_dir(resolved.path, flow.model_id)
    model = ModelRef(model_id=flow.model_id, path=str(resolved.path), content_hash=resolved.content_hash,
                     family=family.name)
    # as the flow's tokenize task encodes the prompts (tasks/tokenize.py)
    data = tokenize_dataset(resolve_dataset(flow.dataset).path, model.path, kind="prompts",
                            max_length=flow.max_length, max_bad_fraction=flow.max_bad_fraction,
                            enable_thinking=flow.enable_thinking, chat_template=family.chat_template)
    config = flow.run_config(model, str(data.path), work / "checkpoints", run_id=None)
    config = config.model_copy(update={"mlflow_run_id": None, "tracking_uri": None})  # no MLflow run
    return config.write(work / "run.json")


def _summary(ends: list[float], rollout: list[float], update: list[float], rewards: list[float],
             lengths: list[float]) -> dict:
    """Steps after the first: wall time from the end of step 1 to the end of the last, and per-step means."""
    measured = len(ends) - 1
    wall = ends[-1] - ends[0]
    mean = lambda values: sum(values[1:]) / measured  # noqa: E731
    return {"steps": len(ends), "seconds": wall, "steps_per_s": measured / wall, "step_s": wall / measured,
            "rollout_s": mean(rollout), "update_s": mean(update),
            "other_s": wall / measured - mean(rollout) - mean(update), "completion_length": mean(lengths),
            "first_reward": rewards[0], "last_reward": rewards[-1], "rewards": rewards,
            "rollout_steps": rollout, "update_steps": update}


def run_ours(config_path: str) -> dict:
    from twinkle_core.train import TrainRunConfig
    from twinkle_core.train.grpo import GRPORecipe

    steps: list[dict] = []

    class Recorded:  # in place of the MLflow logger: the metrics the recipe logs once per optimizer step
        def log(self, metrics, step):
            steps.append({**metrics, "step": step, "at": time.perf_counter()})

        def flush(self):
            pass

    recipe = GRPORecipe(TrainRunConfig.read(config_path))
    recipe.setup()
    recipe.metrics = Recorded()
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    return {**_summary([s["at"] for s in steps], [s["rollout_s"] for s in steps], [s["update_s"] for s in steps],
                       [s["reward"] for s in steps], [s["completion_length"] for s in steps]),
            "padding_free": bool(getattr(recipe.model, "padding_free", False))}


def trl_reward(name: str, function, options: dict):
    """One of our reward functions as trl calls it: conversational prompts and completions become their text."""
    def text(value):
        return value[-1]["content"] if isinstance(value, list) else value

    def reward(prompts, completions, **fields):
        return function(prompts=[text(p) for p in prompts], completions=[text(c) for c in completions],
                        **fields, **options)

    reward.__name__ = name  # trl logs rewards/<name>/mean
    return reward


def run_trl(config_path: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hf_clock import StepClock
    from twinkle_core.data import load_tokenized
    from twinkle_core.objectives.grpo import resolve_options
    from twinkle_core.parallel import local_micro_batches
    from twinkle_core.precision.policy import resolve_precision
    from twinkle_core.rl.rewards import load_reward
    from twinkle_core.train import TrainRunConfig

    cfg = TrainRunConfig.read(config_path)
    options = resolve_options(None, None, cfg.objective_options)
    generations, steps = int(options["num_generations"]), cfg.max_steps
    precision = resolve_precision(cfg.mixed_precision, "cpu").compute_dtype
    if precision not in (torch.bfloat16, torch.float32):
        raise SystemExit(f"mixed_precision={cfg.mixed_precision!r}: this benchmark compares bf16 or fp32 on CPU")
    # our seeded order of the prompts, `steps` batches of it, in trl's conversational layout
    examples = load_tokenized(cfg.train_data)
    order = local_micro_batches(examples, cfg.batch_size, cfg.seed, 0, 1)
    chosen = [e for _ in range(steps) for e in next(order)]
    rows = [{"prompt": [{"role": "user", "content": e["prompt_text"]}], **json.loads(e["fields"])} for e in chosen]
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model_path))
    same_prompts = all(
        list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"]) == list(e["prompt_ids"])
        for row, e in zip(rows, chosen))
    weights = options["reward_weights"] or [1.0] * len(options["rewards"])
    rewards = [trl_reward(name, load_reward(name), options["reward_options"].get(name, {}))
               for name in options["rewards"]]

    rollout, logged = [], []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rollout.append(time.perf_counter() - start)
            return out

    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                logged.append(dict(logs))

    clock = StepClock(lambda: None)
    model = AutoModelForCausalLM.from_pretrained(str(cfg.model_path), dtype=precision)
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as output_dir:
        args = GRPOConfig(
            output_dir=output_dir, per_device_train_batch_size=cfg.batch_size * generations,
            gradient_accumulation_steps=1, num_generations=generations,
            max_completion_length=int(options["max_new_tokens"]), temperature=float(options["temperature"]),
            top_p=float(options["top_p"]), top_k=0, learning_rate=cfg.lr, lr_scheduler_type="constant",
            warmup_steps=0, optim="adamw_torch_fused", weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.max_grad_norm, beta=float(options["beta"]), epsilon=float(options["epsilon"]),
            epsilon_high=options["epsilon_high"], num_iterations=int(options["num_iterations"]),
            loss_type=options["loss_type"], scale_rewards="group" if options["scale_rewards"] else "none",
            reward_weights=list(weights), bf16=precision == torch.bfloat16, use_cpu=not torch.cuda.is_available(),
            use_vllm=False, gradient_checkpointing=False, disable_dropout=True, shuffle_dataset=False,
            max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0, seed=cfg.seed, log_completions=False)
        trainer = Timed(model=model, reward_funcs=rewards, args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=tokenizer, peft_config=cfg.lora_config(), callbacks=[clock, Logged()])
        # the KV cache (None: generate's default, on) and the same number of new tokens
        assert trainer.generation_config.use_cache is not False and trainer.generation_config.max_new_tokens == \
            options["max_new_tokens"], trainer.generation_config
        trainer.train()
    update = [step - roll for step, roll in zip(clock.step_seconds, rollout)]
    adapter = next(p.dtype for n, p in trainer.model.named_parameters() if p.requires_grad)
    return {**_summary(clock.ends, rollout, update, [log["reward"] for log in logged],
                       [log["completions/mean_length"] for log in logged]),
            "same_prompt_ids": same_prompts, "adapter_dtype": str(adapter)}


def worker(args) -> None:
    import torch

    result = run_ours(args.run_config) if args.worker == "ours" else run_trl(args.run_config)
    result.update(trainer=args.worker, threads=torch.get_num_threads(), peak_rss_mb=peak_rss_mb())
    print(RESULT + json.dumps(result), flush=True)


def run_child(trainer: str, config_path: Path) -> dict:
    from twinkle_core.launch import cpu_allocator_env

    cmd = [sys.executable, __file__, "--worker", trainer, "--run-config", str(config_path)]
    # Every trainer runs with the allocator settings our launcher gives CPU workers (twinkle_core.launch), so the
    # ratios come from the training code alone.
    env = {**os.environ, **cpu_allocator_env(), "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def spread(runs: list[dict], key: str, digits: int = 2) -> str:
    values = [r[key] for r in runs]
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL)
    parser.add_argument("--trainers", default=",".join(TRAINERS), help=f"of {','.join(TRAINERS)}")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run, the first one not measured")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    parser.add_argument("--run-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is a warm-up")
    trainers = args.trainers.split(",")
    config_path = prepare(args, Path(tempfile.mkdtemp(prefix="bench-grpo-run-")))
    runs: dict[str, list[dict]] = {t: [] for t in trainers}
    for repeat in range(args.repeats):
        for trainer in trainers if repeat % 2 == 0 else trainers[::-1]:
            r = run_child(trainer, config_path)
            runs[trainer].append(r)
            check = "" if "same_prompt_ids" not in r else f", same prompt ids: {r['same_prompt_ids']}"
            print(f"  repeat {repeat + 1} {trainer:4s} {r['steps_per_s']:.4f} steps/s (rollout {r['rollout_s']:.2f} s "
                  f"+ update {r['update_s']:.2f} s + other {r['other_s']:.2f} s) {r['peak_rss_mb']:6.0f} MB  "
                  f"reward {r['first_reward']:.3f} -> {r['last_reward']:.3f}, {r['completion_length']:.1f} "
                  f"completion tokens ({r['steps']} steps{check})", flush=True)
    trl = statistics.median(r["steps_per_s"] for r in runs["trl"]) if "trl" in runs else None
    threads = runs[trainers[0]][0]["threads"]
    print(f"\nGRPO: {args.batch_size} prompts x {args.num_generations} completions of <= "
          f"{args.max_completion_length} tokens per step, {args.steps} steps (first one not measured), "
          f"{threads} threads, median of {args.repeats} (min-max)")
    print("| trainer | steps/s | vs trl | rollout s/step | update s/step | other s/step | completion tokens "
          "| peak RSS MB | reward first -> last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for trainer, rs in runs.items():
        med = statistics.median(r["steps_per_s"] for r in rs)
        ratio = f"{med / trl:.2f}x" if trl else ""
        print(f"| {trainer} | {spread(rs, 'steps_per_s', 4)} | {ratio} | {spread(rs, 'rollout_s')} | "
              f"{spread(rs, 'update_s')} | {statistics.median(r['other_s'] for r in rs):.2f} | "
              f"{statistics.median(r['completion_length'] for r in rs):.1f} | "
              f"{statistics.median(r['peak_rss_mb'] for r in rs):.0f} | "
              f"{statistics.median(r['first_reward'] for r in rs):.3f} -> "
              f"{statistics.median(r['last_reward'] for r in rs):.3f} |")
    print(flush=True)
    print(json.dumps({"settings": json.loads(config_path.read_text()), "runs": runs}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
