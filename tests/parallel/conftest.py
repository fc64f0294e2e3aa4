"""Multi-process fixtures: tiny models, tokenized chats, and the training runs that the tests compare.

Each named run (RUNS) starts `train_worker` once per session, at 1 process with plain `python -m` (the real
single-process path) or under torchrun, and the tests read its per-step metrics, shard sizes and weights.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors.torch import load_file

from embedding_models import save_tiny_bert, write_pairs
from family_models import save_tiny_family_model
from tiny_models import CHATML_TEMPLATE, save_tiny_model
from vision_models import save_tiny_qwen2_5_vl, write_image
from twinkle_core.data import tokenize_dataset
from twinkle_core.launch import run_streaming, torchrun_command
from twinkle_core.train import TrainRunConfig
from twinkle_core.train.recipe import EVENT_PREFIX

TESTS = Path(__file__).resolve().parents[1]
WORKER_PATH = os.pathsep.join([str(TESTS / "parallel"), str(TESTS), str(TESTS.parent)])
RUN_TIMEOUT_S = 240
# 13 conversations of different lengths: with batch_size 3 the last micro-batch of the epoch has 1 row.
CHATS = [("Who are you?", "I am Twinkle, built by the Twinkle Flows team."), ("Name?", "Twinkle."),
         ("Who made you?", "The Twinkle Flows team made me."), ("hi", "Hello! I am Twinkle."),
         ("What can you do?", "I answer questions about Twinkle Flows."), ("Where is Paris?", "In France."),
         ("What is the capital of France?", "The capital of France is Paris."), ("thanks", "You are welcome!"),
         ("Are you a model?", "Yes, a language model called Twinkle."), ("2+2?", "4."),
         ("Tell me about yourself.", "I am Twinkle, a helpful assistant built by the Twinkle Flows team."),
         ("Who trained you?", "The Twinkle Flows team trained me."), ("bye", "Goodbye!")]

# 9 pairs, batch 4: the third step's micro-batch has 1 row (rank 1 takes a stand-in); no accumulation, as
# in-batch negatives come from each micro-batch. SGD: softmax ignores the attention key biases, so their exact
# gradient is 0 and AdamW would turn its float noise into full-size steps that differ between layouts.
INFONCE = dict(objective="infonce", objective_options={"pooling": "mean", "query_prompt": ""}, batch_size=4,
               gradient_accumulation_steps=1, max_steps=3, optimizer="SGD", lr=0.1)

# 9 pairs in micro-batches of 3, 2 per step: the third step holds the epoch's last 3 pairs and the first 3 of
# the next; on 2 ranks a micro-batch of 3 deals 2 + 1 pairs. LoRA: the reference is the base, adapter off.
# SGD, as for InfoNCE: AdamW turns summation-order noise in near-zero gradients into full-size steps.
DPO = dict(objective="preference", objective_options={"loss_type": "sigmoid", "beta": 0.5}, use_lora=True,
           batch_size=3, gradient_accumulation_steps=2, max_steps=3, optimizer="SGD", lr=0.5)

# GRPO on fixed completions (train_worker.FixedSampler): 6 prompts, 3 per rollout (2 + 1 on 2 ranks), 4
# completions each rewarded by their length, 2 optimizer steps per rollout (the second with the clipped ratio
# against the first's log-probs), the k3 KL to the base (LoRA, adapter off). SGD: see INFONCE.
GRPO = dict(objective="grpo", objective_options={
    "rewards": ["length_penalty"], "reward_options": {"length_penalty": {"target_chars": 0, "max_chars": 200}},
    "num_generations": 4, "num_iterations": 2, "beta": 0.1, "max_new_tokens": 8}, use_lora=True, batch_size=3,
    gradient_accumulation_steps=1, max_steps=6, optimizer="SGD", lr=0.5)

# Image chats on a tiny Qwen2.5-VL (test_parallel_vision): 7 rows of 1 or 2 images of 28x28 (4 pixel rows)
# or 56x56 (16 rows), so a rank's pixel_values count differs from its share of the rows. Micro-batches of 3,
# 2 per step: the epoch's third micro-batch has 1 row (rank 1 takes a stand-in). LoRA on the language model
# (vision tower and merger frozen, the default). SGD, as for InfoNCE.
VISION = dict(objective="vision_lm", use_lora=True, batch_size=3, gradient_accumulation_steps=2, max_steps=4,
              optimizer="SGD", lr=0.5)
# Full fine-tuning with the vision tower and the merger unfrozen: every weight of the model trains (SGD, lr 0.1).
VISION_FULL = dict(VISION, use_lora=False, lr=0.1,
                   objective_options={"freeze_vision": False, "freeze_aligner": False})
VISION_ROWS = [("What colour is it?", "It is red.", [("red", 56)]),
               ("Colour?", "Green.", [("green", 28)]),
               ("What colours are these two?", "Blue, then white.", [("blue", 56), ("white", 28)]),
               ("Describe the picture.", "A square of pure white colour.", [("white", 56)]),
               ("Which is brighter?", "The second one.", [("noise", 28), ("white", 56)]),
               ("What is shown?", "Random noise.", [("noise", 56)]),
               ("Is it red?", "No, it is blue.", [("blue", 28)])]

# name: (processes, model, settings). lr 1e-3: see test_parallel_equivalence's docstring.
RUNS: dict[str, tuple[int, str, dict]] = {
    "single": (1, "llama", {}),  # padding-free batches (the default)
    "single_padded": (1, "llama", dict(padding_free=False)),  # padded, as sequence parallelism trains
    "ddp": (2, "llama", dict(parallel=dict(dp_size=2))),
    "native_fsdp": (2, "llama", dict(parallel=dict(strategy="native_fsdp"))),
    "accelerate_fsdp": (2, "llama", dict(parallel=dict(strategy="accelerate"))),
    "hsdp": (4, "llama", dict(parallel=dict(strategy="native_fsdp", dp_size=2, fsdp_size=2))),
    "tp": (2, "llama", dict(parallel=dict(tp_size=2))),
    "sp": (2, "llama", dict(parallel=dict(sp_size=2))),
    "sp_lora": (2, "llama", dict(use_lora=True, parallel=dict(sp_size=2))),
    "sp_native_fsdp": (4, "llama", dict(parallel=dict(strategy="native_fsdp", sp_size=2))),  # fsdp 2 × sp 2
    "sp_accelerate_fsdp": (4, "llama", dict(parallel=dict(sp_size=2))),
    "tp_lora": (2, "llama", dict(use_lora=True, parallel=dict(tp_size=2))),
    "fsdp_tp": (4, "llama", dict(parallel=dict(strategy="native_fsdp", fsdp_size=2, tp_size=2))),
    "dp_tp": (4, "llama", dict(parallel=dict(dp_size=2, tp_size=2))),
    # Qwen3.5: per-head q/k norms (gradients summed over tp ranks), linear attention with gathered outputs.
    # SGD: see test_qwen3_5_under_tp_sums_the_per_head_norm_gradients_and_matches.
    "single_qwen3_5": (1, "qwen3_5", dict(optimizer="SGD", lr=0.1)),
    "tp_qwen3_5": (2, "qwen3_5", dict(optimizer="SGD", lr=0.1, parallel=dict(tp_size=2))),
    "single_lora": (1, "llama", dict(use_lora=True)),
    "accelerate_fsdp_lora": (2, "llama", dict(use_lora=True)),
    "single_bf16_lora": (1, "llama", dict(use_lora=True, mixed_precision="bf16")),
    "native_fsdp_bf16_lora": (2, "llama", dict(use_lora=True, mixed_precision="bf16",
                                               parallel=dict(strategy="native_fsdp"))),
    # Router aux loss off and SGD: see test_moe_under_ddp_matches_one_process.
    "single_moe": (1, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1)),
    "ddp_moe": (2, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1, parallel=dict(dp_size=2))),
    # Expert parallelism (test_parallel_ep): experts split over the 2 ranks, the rest DDP or FSDP.
    "ep_ddp_moe": (2, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1,
                                  parallel=dict(dp_size=2, ep_size=2))),
    "ep_fsdp_moe": (2, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1,
                                   parallel=dict(strategy="native_fsdp", ep_size=2))),
    "ep_accelerate_fsdp_moe": (2, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1,
                                              parallel=dict(ep_size=2))),
    "ep_hsdp_moe": (4, "moe", dict(router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1,
                                   parallel=dict(strategy="native_fsdp", dp_size=2, fsdp_size=2, ep_size=2))),
    "single_lora_moe": (1, "moe", dict(use_lora=True, router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1)),
    "ep_lora_moe": (2, "moe", dict(use_lora=True, router_aux_loss_coef=0.0, optimizer="SGD", lr=0.1,
                                   parallel=dict(ep_size=2))),
    # Router aux loss on (the config's 0.001): the global micro-batch's aux loss under data parallelism.
    "single_moe_aux": (1, "moe", dict(optimizer="SGD", lr=0.1)),
    "ep_moe_aux": (2, "moe", dict(optimizer="SGD", lr=0.1, parallel=dict(dp_size=2, ep_size=2))),
    "single_moe_adamw": (1, "moe", dict(router_aux_loss_coef=0.0)),
    "ep_moe_adamw": (2, "moe", dict(router_aux_loss_coef=0.0, parallel=dict(dp_size=2, ep_size=2))),
    # InfoNCE on a tiny BERT (test_parallel_infonce): negatives gathered over the ranks, with their gradient or
    # detached (infonce_detached, registered by train_worker, as Twinkle gathers them).
    "single_infonce": (1, "bert", dict(INFONCE)),
    "ddp_infonce": (2, "bert", dict(INFONCE, parallel=dict(dp_size=2))),
    "fsdp_infonce": (2, "bert", dict(INFONCE, parallel=dict(strategy="native_fsdp"))),
    "ddp_infonce_detached": (2, "bert", dict(INFONCE, objective="infonce_detached", parallel=dict(dp_size=2))),
    # Accumulation through cached embeddings: 2 micro-batches of 2 make each step (test_parallel_infonce).
    "single_infonce_cached": (1, "bert", dict(INFONCE, batch_size=2, gradient_accumulation_steps=2)),
    "ddp_infonce_cached": (2, "bert", dict(INFONCE, batch_size=2, gradient_accumulation_steps=2,
                                           parallel=dict(dp_size=2))),
    # DPO with LoRA (test_parallel_preference): 9 pairs, 2 micro-batches of 3 per step, the base as reference.
    "single_dpo": (1, "llama_pref", dict(DPO)),
    "ddp_dpo": (2, "llama_pref", dict(DPO, parallel=dict(dp_size=2))),
    "native_fsdp_dpo": (2, "llama_pref", dict(DPO, parallel=dict(strategy="native_fsdp"))),
    "accelerate_fsdp_dpo": (2, "llama_pref", dict(DPO, parallel=dict(strategy="accelerate"))),
    # GRPO on fixed completions (test_parallel_grpo).
    "single_grpo": (1, "llama_prompts", dict(GRPO)),
    "ddp_grpo": (2, "llama_prompts", dict(GRPO, parallel=dict(dp_size=2))),
    "native_fsdp_grpo": (2, "llama_prompts", dict(GRPO, parallel=dict(strategy="native_fsdp"))),
    # The policy's own sampler (train_worker: runs named *_sampled) under Accelerate's FSDP, the default.
    "accelerate_fsdp_grpo_sampled": (2, "llama_prompts", dict(GRPO, max_steps=4, parallel=dict(strategy="accelerate"))),
    # Image chats on a tiny Qwen2.5-VL (test_parallel_vision).
    "single_vl": (1, "qwen_vl", dict(VISION)),
    "ddp_vl": (2, "qwen_vl", dict(VISION, parallel=dict(dp_size=2))),
    "native_fsdp_vl": (2, "qwen_vl", dict(VISION, parallel=dict(strategy="native_fsdp"))),
    "accelerate_fsdp_vl": (2, "qwen_vl", dict(VISION, parallel=dict(strategy="accelerate"))),
    "single_vl_full": (1, "qwen_vl", dict(VISION_FULL)),
    "native_fsdp_vl_full": (2, "qwen_vl", dict(VISION_FULL, parallel=dict(strategy="native_fsdp"))),
}


@dataclass
class Run:
    """What one training run left behind."""

    result: dict
    weights: dict
    events: list[dict] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [step["loss"] for step in self.result["steps"]]

    def event(self, name: str) -> dict:
        return next(e for e in self.events if e["event"] == name)


class Workspace:
    def __init__(self, root: Path):
        self.root = root
        data = root / "train.jsonl"
        data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}) + "\n"
                                for q, a in CHATS))
        self.models = {
            "llama": (save_tiny_model(root / "llama"), "llama3"),
            "moe": (save_tiny_family_model("qwen3_5", root / "moe", "moe", tokenizer_chat_template=CHATML_TEMPLATE),
                    "qwen3_5"),
            "qwen3_5": (save_tiny_family_model("qwen3_5", root / "qwen3_5", "dense",
                                               tokenizer_chat_template=CHATML_TEMPLATE), "qwen3_5"),
        }
        self.data = {name: tokenize_dataset(data, path, kind="chat", max_length=128).path
                     for name, (path, _) in self.models.items()}
        # Preference pairs on the same Llama: each question's answer, against one other identity.
        pairs = root / "pairs_preference.jsonl"
        pairs.write_text("".join(json.dumps({"prompt": q, "chosen": a, "rejected": "I am SmolLM, by Hugging Face."})
                                 + "\n" for q, a in CHATS[:9]))
        self.models["llama_pref"] = self.models["llama"]
        self.data["llama_pref"] = tokenize_dataset(pairs, self.models["llama"][0], kind="preference",
                                                   max_length=128).path
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in CHATS[:6]))
        self.models["llama_prompts"] = self.models["llama"]
        self.data["llama_prompts"] = tokenize_dataset(prompts, self.models["llama"][0], kind="prompts",
                                                      max_length=128).path
        self.models["bert"] = (save_tiny_bert(root / "bert"), "bert_embedding")
        self.data["bert"] = tokenize_dataset(write_pairs(root / "pairs.jsonl"), root / "bert", kind="pairs",
                                             max_length=64).path
        self._runs: dict[str, Run] = {}

    def _add_vision(self) -> None:
        """The tiny Qwen2.5-VL and its image chats, built on first use (only the vision runs need them)."""
        images = self.root / "vision" / "images"
        colours = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
        rows = []
        for question, answer, media in VISION_ROWS:
            paths = []
            for name, size in media:
                path = images / f"{name}{size}.png"
                write_image(path, colours.get(name), size=(size, size), seed=size if name == "noise" else None)
                paths.append(f"images/{path.name}")
            rows.append({"messages": [{"role": "user", "content": "<image>" * len(paths) + question},
                                      {"role": "assistant", "content": answer}], "images": paths})
        data = self.root / "vision" / "train.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        model = save_tiny_qwen2_5_vl(self.root / "qwen_vl")
        self.models["qwen_vl"] = (model, "qwen2_5_vl")
        # min_pixels 28x28: the small images keep their size (2x2 patches), the large ones 4x4.
        self.data["qwen_vl"] = tokenize_dataset(data, model, kind="vision_chat", max_length=256,
                                                encode_options={"min_pixels": 28 * 28, "max_pixels": 56 * 56}).path

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": WORKER_PATH, "TWINKLE_CACHE": str(self.root / "cache")}

    def write_config(self, name: str, model: str = "llama", parallel: dict | None = None, **settings) -> Path:
        path, family = self.models[model]
        values = dict(
            model_id=str(path), model_path=path, family=family, train_data=self.data[model],
            checkpoint_dir=self.root / name / "checkpoints", mixed_precision="no", parallel=parallel or {},
            use_lora=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear",
            optimizer="AdamW", lr=1e-3, weight_decay=0.0, scheduler="ConstantWarmupScheduler", warmup_ratio=0.0,
            max_grad_norm=1.0, epochs=1, max_steps=4, batch_size=3, gradient_accumulation_steps=2, seed=0,
            router_aux_loss_coef=None)
        return TrainRunConfig(**{**values, **settings}).write(self.root / f"{name}.json")

    def launch(self, cmds: list[list[str]], name: str) -> Run:
        """Run the commands together (one per torchrun agent) and read the run's outputs."""
        events, errors = [], []

        def follow(line: str) -> None:
            if line.startswith(EVENT_PREFIX):
                events.append(json.loads(line[len(EVENT_PREFIX):]))

        def start(cmd: list[str]) -> None:
            try:
                run_streaming(cmd, follow, timeout_s=RUN_TIMEOUT_S, env=self.env())
            except Exception as exc:  # noqa: BLE001 - re-raised below in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(cmd,)) for cmd in cmds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        out = self.root / name / "out"
        return Run(json.loads((out / "result.json").read_text()), load_file(out / "weights.safetensors"), events)

    def run(self, name: str) -> Run:
        """The named run from RUNS, started once per session."""
        if name not in self._runs:
            nproc, model, settings = RUNS[name]
            if model not in self.models and model == "qwen_vl":
                self._add_vision()
            settings = dict(settings, parallel=dict(settings.get("parallel", {}), nproc_per_node=nproc))
            args = [str(self.write_config(name, model, **settings)), str(self.root / name / "out")]
            cmd = ([sys.executable, "-m", "train_worker", *args] if nproc == 1
                   else torchrun_command("train_worker", args, nproc_per_node=nproc))
            self._runs[name] = self.launch([cmd], name)
        return self._runs[name]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("parallel")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TWINKLE_CACHE", str(root / "cache"))
        yield Workspace(root)
