"""Every user-facing training knob, defined once: its type, bounds, choices and help text.

Each field is an `Annotated` type (its one definition); each group is a small pydantic mixin of such
fields with the common default. A flow's parameter model and a worker's run config are composed from the
groups, so `python -m flows.sft --help`, the Prefect UI form and the run file all read the same text. A
flow that wants another default re-declares only the default, with the same type (a re-declared field
keeps its place in the form):

    class PretrainConfig(OptimizerFields, ...):
        lr: LearningRate = 5e-5

Pydantic orders the fields from the last base class to the first, so a config lists its groups last-first.
`tests/test_config_fields.py` fails when two configs give one field name different types or help texts.
"""
from __future__ import annotations

from enum import Enum
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator


class Strategy(str, Enum):
    accelerate = "accelerate"  # FSDP managed by Accelerate (the default)
    native_fsdp = "native_fsdp"  # torch.distributed.fsdp.fully_shard


Backend = Literal["transformers", "megatron"]
PrecisionName = Literal["auto", "bf16", "fp16", "fp8", "no"]
TransformerImplName = Literal["local", "transformer_engine"]
Fp8RecipeName = Literal["tensorwise", "delayed"]
SchedulerName = Literal["CosineWarmupScheduler", "LinearWarmupScheduler", "ConstantWarmupScheduler"]

# ----- what to train on ------------------------------------------------------------------------------------
ModelId = Annotated[str, Field(description="Model: ms://org/name[@rev], hf://org/name[@rev], pkg://package/path, or a local path (GGUF files are converted once; a Megatron checkpoint folder of this project where the flow reads one).")]
DatasetId = Annotated[str, Field(description="Training data: ms://org/name[@rev][:split], hf://…, pkg://… or a local .jsonl/.json/.parquet; pretrain also takes a Megatron-LM corpus PREFIX (PREFIX.bin + PREFIX.idx) and a weighted blend \"0.7 A 0.3 B\".")]
EvalDatasetId = Annotated[str, Field(description="Held-out data of the same kind: its loss and the before/after answers.")]
ChatTemplateChoice = Annotated[str | None, Field(description="Chat template, for any family: one of ours by name (qwen3, llama3, chatml, …) or a .jinja file. Default: the tokenizer's own, else the tested family's; a model of an untested family with neither needs this.")]
TrustRemoteCode = Annotated[bool, Field(description="Run the modelling code a checkpoint ships beside its weights (config.json auto_map). Off by default: it executes that code on this machine with your rights.")]
AllowPickleWeights = Annotated[bool, Field(description="Load a checkpoint that ships its weights only as pickle files (pytorch_model.bin), read with torch.load(weights_only=True). Off by default: weights load from safetensors only.")]
BackendName = Annotated[Backend, Field(description="Training backend: transformers (Transformers + Accelerate/FSDP, DDP, TP, SP, EP), or megatron (megatron-core: tp_size × pp_size, ep_size, data parallel over the rest; Megatron-capable families only).")]

# ----- data ----------------------------------------------------------------------------------------------
MaxLength = Annotated[int, Field(ge=16, description="Tokens per sample; longer samples are truncated.")]
Streaming = Annotated[bool, Field(description="Read --dataset as a stream (hub splits, or a local file) and encode it as it is read: nothing is copied to the local disk but the tokenised rows.")]
Packing = Annotated[bool, Field(description="Pack several samples into one sequence (attention kept per sample).")]
PaddingFree = Annotated[bool, Field(description="Train each micro-batch with no padding: its samples end to end in one row, attention kept per sample (transformers backend, SDPA models attending over whole sequences; others are padded). The loss is the same.")]
Compile = Annotated[bool, Field(description="torch.compile each decoder layer (transformers backend, one process): steps about a tenth faster on CPU after a first step that compiles (over a minute), so it pays off on long runs; not bit-equal in bf16. Off by default.")]
GroupByLength = Annotated[bool, Field(description="Micro-batches of rows of similar length (less padding), in a seeded order that resumes like the plain shuffle.")]
NumProc = Annotated[int | None, Field(ge=1, description="Worker processes that tokenise the data set; empty: the machine's cores (at most 8). The result does not depend on it.")]
MaxBadFraction = Annotated[float, Field(ge=0, le=1, description="Fail when more than this fraction of rows is malformed.")]
EnableThinking = Annotated[bool, Field(description="Thinking-mode families (Qwen 3.5, DeepSeek R1/V4): train the reasoning of the last turn; false trains without it.")]

# ----- vision-language models -----------------------------------------------------------------------------
FreezeVision = Annotated[bool, Field(description="Vision-language models: keep the vision tower's weights fixed (and LoRA off it).")]
FreezeAligner = Annotated[bool, Field(description="Vision-language models: keep the aligner (the projector from vision features into the language model: Qwen's merger) fixed (and LoRA off it).")]
FreezeLlm = Annotated[bool, Field(description="Vision-language models: keep the language model fixed (and LoRA off it); train only the parts left unfrozen.")]
MinPixels = Annotated[int | None, Field(ge=1, description="Vision-language models: resize smaller images (and video frames) up to at least this many pixels (empty: the checkpoint's preprocessor setting).")]
MaxPixels = Annotated[int | None, Field(ge=1, description="Vision-language models: resize larger images (and video frames) down to at most this many pixels (empty: the checkpoint's preprocessor setting).")]
VideoFps = Annotated[float, Field(gt=0, description="Vision-language models: video frames sampled per second.")]
MaxFrames = Annotated[int, Field(ge=1, description="Vision-language models: at most this many frames per video (spread over the whole video).")]

# ----- precision -----------------------------------------------------------------------------------------
MixedPrecisionMode = Annotated[PrecisionName, Field(description="Precision: auto (bf16 where the hardware has it natively, else fp16 on GPUs and fp32 on CPUs), bf16, fp16, fp8 (H100-class GPU) or no (fp32).")]

# ----- LoRA ----------------------------------------------------------------------------------------------
UseLora = Annotated[bool, Field(description="Train a LoRA adapter; false trains all parameters.")]
LoraRank = Annotated[int, Field(ge=1, description="LoRA rank.")]
LoraAlpha = Annotated[int, Field(ge=1, description="LoRA alpha (scaling = alpha / r).")]
LoraDropout = Annotated[float, Field(ge=0, lt=1, description="LoRA dropout.")]
LoraTargets = Annotated[list[str] | str, Field(description="Modules to adapt (names, or 'all-linear').")]
RegisterAs = Annotated[Literal["adapter", "merged"], Field(description=(
    "How a LoRA run is registered in MLflow: 'adapter' (small; loads on its base, which the version names) or "
    "'merged' (the adapter folded into its base: a standalone model)."))]

# ----- optimization --------------------------------------------------------------------------------------
OptimizerName = Annotated[str, Field(description="A torch.optim optimizer class name (megatron: AdamW or SGD, megatron-core's own).")]
LearningRate = Annotated[float, Field(gt=0, description="Peak learning rate.")]
WeightDecay = Annotated[float, Field(ge=0, description="Weight decay.")]
Scheduler = Annotated[SchedulerName, Field(description="Learning-rate schedule after the warm-up: cosine, linear or constant.")]
WarmupRatio = Annotated[float, Field(ge=0, lt=1, description="Fraction of steps spent warming up.")]
MaxGradNorm = Annotated[float, Field(gt=0, description="Gradient clipping norm.")]
Seed = Annotated[int, Field(description="Random seed (data order and split, adapter init).")]

# ----- the training loop ---------------------------------------------------------------------------------
Epochs = Annotated[float, Field(gt=0, description="Passes over the training data.")]
MaxSteps = Annotated[int | None, Field(ge=1, description="Stop after this many optimizer steps (overrides epochs).")]
BatchSize = Annotated[int, Field(ge=1, description="Samples per micro-batch, in total over all data-parallel processes (each takes its share).")]
GradientAccumulation = Annotated[int, Field(ge=1, description="Micro-batches per optimizer step.")]
MicroBatchSize = Annotated[int, Field(ge=1, description="Backend megatron: rows per micro-batch of the pipeline schedule.")]
KeepCheckpoints = Annotated[int, Field(ge=1, description="How many of the newest resumable training states to keep (a damaged newest one is skipped on resume for the one before).")]
CheckpointEvery = Annotated[int | None, Field(ge=1, description="Save a resumable training state every N optimizer steps; a retried flow run resumes from the last one (empty: never).")]
RouterAuxLossCoef = Annotated[float | None, Field(ge=0, description="MoE router load-balancing loss weight (empty: the model config's; 0: off).")]

# ----- pre-training on megatron-core --------------------------------------------------------------------
SeqLength = Annotated[int, Field(ge=8, description="Tokens per packed sequence.")]
ValidationFraction = Annotated[float, Field(gt=0, lt=1, description="Fraction of the documents held out for the validation loss.")]
DocumentMasks = Annotated[bool, Field(description="Keep attention inside each document of a packed sequence.")]
GlobalBatchSize = Annotated[int, Field(ge=1, description="Sequences per step over all data-parallel processes.")]
EvalBatches = Annotated[int, Field(ge=1, description="Validation micro-batches per data-parallel process for the held-out loss.")]
VirtualPipelineStages = Annotated[int | None, Field(ge=2, description="Model chunks per pipeline rank (interleaved 1F1B; needs pp_size > 1; empty: none).")]

# ----- embedding models (InfoNCE) ----------------------------------------------------------------------
PoolingName = Annotated[Literal["mean", "cls", "last"] | None, Field(description="How hidden states become one embedding: mean over the mask, the first (CLS) token, or the last (EOS) token (empty: the checkpoint's pooling config, else the family's).")]
Temperature = Annotated[float, Field(gt=0, description="InfoNCE temperature: scores are q·d / temperature (scale = 1 / temperature).")]
SameSideNegatives = Annotated[bool, Field(description="Also contrast each query with the other queries and its positive with the other documents (Qwen3-Embedding's loss).")]
QueryTask = Annotated[str | None, Field(description="The task text of the query instruction ('Instruct: {task}\nQuery:' for Qwen3-Embedding; empty: the checkpoint's prompt, else the published default).")]

# ----- preference training (DPO and its kin) -----------------------------------------------------------
PreferenceLoss = Annotated[Literal["sigmoid", "ipo", "simpo", "orpo"], Field(description="Preference loss: sigmoid (DPO), ipo, simpo (reference-free, length-normalised, with a margin gamma) or orpo (SFT plus an odds-ratio term, reference-free).")]
PreferenceBeta = Annotated[float, Field(gt=0, description="beta: DPO/IPO's KL strength (reward = beta * log-ratio), SimPO's reward scale, ORPO's lambda.")]
LabelSmoothing = Annotated[float, Field(ge=0, lt=0.5, description="Share of pairs assumed mislabelled (conservative DPO; sigmoid and simpo).")]
SimpoGamma = Annotated[float, Field(ge=0, description="SimPO's target reward margin gamma.")]
RpoAlpha = Annotated[float, Field(ge=0, description="Weight of an SFT term on the chosen reply added to sigmoid/ipo (RPO; 0: none).")]
PrecomputeReference = Annotated[bool, Field(description="Compute the reference log-probs once in a cached task before training, so training holds no reference model (sigmoid, ipo).")]

# ----- online RL (GRPO) ---------------------------------------------------------------------------------
NumGenerations = Annotated[int, Field(ge=2, description="Completions sampled per prompt (a group; its rewards give the advantages).")]
NumIterations = Annotated[int, Field(ge=1, description="Optimizer steps on each batch of rollouts (the clipped ratio matters from the second).")]
MaxCompletionLength = Annotated[int, Field(ge=1, description="Tokens sampled per completion at most.")]
SamplingTemperature = Annotated[float, Field(gt=0, description="Sampling temperature of the rollouts.")]
TopP = Annotated[float, Field(gt=0, le=1, description="Nucleus sampling of the rollouts (1: off).")]
ScaleRewards = Annotated[bool, Field(description="Divide each group's centred rewards by their std (false: Dr. GRPO's unscaled advantages).")]
GrpoLossType = Annotated[Literal["grpo", "dapo", "dr_grpo"], Field(description="GRPO loss reduction: grpo (each completion's token mean), dapo (the step's token mean) or dr_grpo (token sum / max_completion_length).")]
KlBeta = Annotated[float, Field(ge=0, description="Weight of the k3 KL term to the reference (the base; 0: no KL, no reference pass).")]
ClipEpsilon = Annotated[float, Field(gt=0, lt=1, description="PPO clip: the ratio is kept within [1 - epsilon, 1 + epsilon_high].")]
ClipEpsilonHigh = Annotated[float | None, Field(gt=0, description="Upper clip (DAPO's clip-higher); empty: epsilon.")]
RewardNames = Annotated[list[str], Field(min_length=1, description="Reward functions: built-in (exact_match, numeric_match, format, length_penalty) or module:function.")]
RewardWeights = Annotated[list[float] | None, Field(description="One weight per reward function (empty: 1 each).")]
RewardOptions = Annotated[dict[str, dict], Field(description="Keyword arguments per reward function, e.g. {\"format\": {\"pattern\": \"...\"}}.")]

# ----- multi-tenant LoRA --------------------------------------------------------------------------------
TenantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]+$", description="Tenant name (letters, digits, '_', '-'): names its adapter, MLflow run and registered model.")]
MixedBatches = Annotated[bool, Field(description="Train every tenant's micro-batch of a round in one mixed batch (one base-model pass); false: one after another.")]
MaxLoras = Annotated[int | None, Field(ge=1, description="Adapter slots on the model (empty: the number of tenants).")]
MaxR = Annotated[int | None, Field(ge=1, description="Largest LoRA rank allowed (empty: the largest tenant rank).")]

# ----- processes and parallelism -------------------------------------------------------------------------
NprocPerNode = Annotated[int, Field(ge=1, description="Training processes on this machine (alone, on transformers: FSDP over them).")]
Nnodes = Annotated[int, Field(ge=1, description="Machines in the run: start one flow run (or torchrun) per machine with the same settings except node_rank.")]
NodeRank = Annotated[int, Field(ge=0, description="This machine's index, 0 .. nnodes-1.")]
RdzvEndpoint = Annotated[str | None, Field(description="HOST:PORT where the machines meet (node 0 by convention), the same on every machine; needed when nnodes > 1.")]
RdzvId = Annotated[str, Field(min_length=1, description="Rendezvous id: the same on every machine of one run, new for each run.")]
MaxRestarts = Annotated[int, Field(ge=0, description="Times torchrun restarts the workers after a failure.")]
StrategyName = Annotated[Strategy, Field(description="accelerate (FSDP via Accelerate) or native_fsdp (with tp_size > 1 FSDP is always native).")]
DpSize = Annotated[int, Field(ge=1, description="Data-parallel replicas (alone: DDP; with FSDP: HSDP).")]
FsdpSize = Annotated[int | None, Field(ge=1, description="FSDP shard group size (empty: the processes that dp_size, sp_size and tp_size leave).")]
SpSize = Annotated[int, Field(ge=1, description="Sequence-parallel size: processes each sequence is split over (Ulysses; must divide the attention heads).")]
TpSize = Annotated[int, Field(ge=1, description="Tensor-parallel size: processes each weight matrix is split over (LoRA or full); transformers: the processes left are FSDP (FSDP × TP); megatron: data parallel over what tp × pp leave.")]
PpSize = Annotated[int, Field(ge=1, description="Pipeline-parallel size (backend megatron: 1F1B over the micro-batches).")]
EpSize = Annotated[int, Field(ge=1, description="Expert-parallel size (MoE models): experts split over this many processes.")]
CpSize = Annotated[int, Field(ge=1, description="Backend megatron: context-parallel size: each sequence split over this many processes inside Transformer Engine's attention (needs transformer_impl=transformer_engine; sequence lengths are padded to a multiple of 2 x cp_size).")]
TransformerImpl = Annotated[TransformerImplName | None, Field(description="Backend megatron: layer implementation: local (megatron-core's plain torch layers; CPU and GPU) or transformer_engine (Transformer Engine's fused layers: fp8, context parallelism, packed sequences; CUDA only). Empty: transformer_engine where CUDA and Transformer Engine are present, else local.")]
Fp8Recipe = Annotated[Fp8RecipeName, Field(description="mixed_precision=fp8: how float8 scales are chosen: tensorwise (current scaling: each tensor by its own amax as it is cast; the Transformers backend's only one) or delayed (backend megatron: from a history of past amaxes, Transformer Engine's DelayedScaling).")]
SequenceParallel = Annotated[bool, Field(description="Transformers: Ulysses over the processes dp, fsdp and tp leave (sets sp_size); megatron: split activations along the sequence over the tp ranks (needs tp_size > 1).")]

# ----- evaluation, registry, bookkeeping -----------------------------------------------------------------
EvalPrompts = Annotated[int, Field(ge=0, description="Held-out prompts answered greedily by the base and trained model.")]
MaxNewTokens = Annotated[int, Field(ge=1, description="Tokens generated per answer.")]
RegisteredModelName = Annotated[str | None, Field(description="MLflow registered model name (default: from the model id).")]
ExperimentName = Annotated[str, Field(description="MLflow experiment.")]
OutputDir = Annotated[str, Field(description="Where run folders (configs, checkpoints, eval) are written.")]
TimeoutMinutes = Annotated[float, Field(gt=0, description="Kill the worker processes (training, conversion) after this long.")]
DeviceLimit = Annotated[str | None, Field(description="Prefect global concurrency limit that training takes nproc_per_node slots of; runs queue while it is full (no such limit on the server: no waiting; empty: never wait).")]


class ModelSourceFields(BaseModel):
    """The model, the chat template it renders with, whether its own code may run."""

    model_id: ModelId
    chat_template: ChatTemplateChoice = None
    trust_remote_code: TrustRemoteCode = False
    allow_pickle_weights: AllowPickleWeights = False


class ModelLoadFields(BaseModel):
    """What loading a downloaded model needs: its family, the template the run chose, remote code or not."""

    family: str
    template_source: str | None = Field(None, description="Jinja source of the chat template the run chose (None: "
                                                           "the tokenizer's own, else the family's).")
    trust_remote_code: TrustRemoteCode = False
    allow_pickle_weights: AllowPickleWeights = False

    def load_options(self) -> dict:
        """The keyword arguments TransformersModel takes for these."""
        return {"family": self.family, "chat_template": self.template_source,
                "trust_remote_code": self.trust_remote_code, "allow_pickle_weights": self.allow_pickle_weights}

    def ref_options(self) -> dict:
        """These fields as they are, for another config of this group."""
        return {name: getattr(self, name) for name in ModelLoadFields.model_fields}


class DataSourceFields(BaseModel):
    """The training data and its held-out part."""

    dataset: DatasetId
    eval_dataset: EvalDatasetId
    streaming: Streaming = False


class BackendFields(BaseModel):
    """Which backend trains, in which precision."""

    backend: BackendName = "transformers"
    mixed_precision: MixedPrecisionMode = "auto"


class _PackingField(BaseModel):
    packing: Packing = False


class ChatDataFields(BaseModel):
    """How chat rows become training samples."""

    max_length: MaxLength = 512
    max_bad_fraction: MaxBadFraction = 0.01
    num_proc: NumProc = None
    enable_thinking: EnableThinking = True


class PackedChatDataFields(ChatDataFields, _PackingField):
    """Chat rows, optionally packed several to a sequence."""


class EmbeddingFields(BaseModel):
    """How an embedding model pools, and how InfoNCE scores its candidates."""

    pooling: PoolingName = None
    temperature: Temperature = 0.1
    same_side_negatives: SameSideNegatives = False
    query_task: QueryTask = None

    def objective_options(self) -> dict:
        """The infonce objective's options these settings describe (empty ones left to the checkpoint)."""
        options = {"temperature": self.temperature, "same_side": self.same_side_negatives,
                   "pooling": self.pooling, "query_task": self.query_task}
        return {key: value for key, value in options.items() if value is not None}


class VisionFields(BaseModel):
    """What a vision-language model trains, and how its images and videos are sized and sampled."""

    freeze_vision: FreezeVision = True
    freeze_aligner: FreezeAligner = True
    freeze_llm: FreezeLlm = False
    min_pixels: MinPixels = None
    max_pixels: MaxPixels = None
    fps: VideoFps = 2.0
    max_frames: MaxFrames = 64

    def objective_options(self) -> dict:
        """The vision_lm objective's options (twinkle_core.objectives.vision); empty sizes are the checkpoint's."""
        options = {name: getattr(self, name) for name in VisionFields.model_fields}
        return {key: value for key, value in options.items() if value is not None}


class EmbeddingDataFields(BaseModel):
    """How embedding rows become training samples."""

    max_length: MaxLength = 128
    max_bad_fraction: MaxBadFraction = 0.01
    num_proc: NumProc = None


class PreferenceFields(BaseModel):
    """Which preference loss, and against what reference."""

    loss_type: PreferenceLoss = "sigmoid"
    beta: PreferenceBeta = 0.1
    label_smoothing: LabelSmoothing = 0.0
    simpo_gamma: SimpoGamma = 0.5
    rpo_alpha: RpoAlpha = 0.0
    precompute_reference: PrecomputeReference = False

    def objective_options(self) -> dict:
        """The preference objective's options (twinkle_core.objectives.preference)."""
        return {"loss_type": self.loss_type, "beta": self.beta, "label_smoothing": self.label_smoothing,
                "simpo_gamma": self.simpo_gamma, "rpo_alpha": self.rpo_alpha,
                "precompute_reference": self.precompute_reference}


class GrpoFields(BaseModel):
    """Rollouts, rewards and the GRPO loss."""

    rewards: RewardNames = ["numeric_match"]
    reward_weights: RewardWeights = None
    reward_options: RewardOptions = {}
    num_generations: NumGenerations = 4
    num_iterations: NumIterations = 1
    max_completion_length: MaxCompletionLength = 64
    sampling_temperature: SamplingTemperature = 1.0
    top_p: TopP = 1.0
    scale_rewards: ScaleRewards = True
    grpo_loss_type: GrpoLossType = "grpo"
    kl_beta: KlBeta = 0.0
    epsilon: ClipEpsilon = 0.2
    epsilon_high: ClipEpsilonHigh = None

    def objective_options(self) -> dict:
        """The grpo objective's options (twinkle_core.objectives.grpo) and its rollouts' (twinkle_core.train.grpo)."""
        return {"loss_type": self.grpo_loss_type, "beta": self.kl_beta, "epsilon": self.epsilon,
                "epsilon_high": self.epsilon_high, "num_generations": self.num_generations,
                "num_iterations": self.num_iterations, "max_new_tokens": self.max_completion_length,
                "max_completion_length": self.max_completion_length, "temperature": self.sampling_temperature,
                "top_p": self.top_p, "scale_rewards": self.scale_rewards, "rewards": list(self.rewards),
                "reward_weights": self.reward_weights, "reward_options": dict(self.reward_options)}


class LoraFields(BaseModel):
    """One LoRA adapter."""

    lora_r: LoraRank = 8
    lora_alpha: LoraAlpha = 32
    lora_dropout: LoraDropout = 0.0
    lora_target_modules: LoraTargets = "all-linear"

    def lora_config(self):
        """The PEFT LoraConfig these settings describe."""
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.lora_target_modules, task_type="CAUSAL_LM")


class _UseLoraField(BaseModel):
    use_lora: UseLora = True


class AdapterFields(LoraFields, _UseLoraField):
    """A LoRA adapter, or (use_lora=false) every weight."""

    register_as: RegisterAs = "adapter"


class OptimizerFields(BaseModel):
    """The optimizer, its schedule and the seed."""

    optimizer: OptimizerName = "AdamW"
    lr: LearningRate = 1e-3
    weight_decay: WeightDecay = 0.0
    scheduler: Scheduler = "CosineWarmupScheduler"
    warmup_ratio: WarmupRatio = 0.05
    max_grad_norm: MaxGradNorm = 1.0
    seed: Seed = 42


class LoopFields(BaseModel):
    """How long training runs and how rows make a step."""

    epochs: Epochs = 3.0
    max_steps: MaxSteps = None
    batch_size: BatchSize = 8
    gradient_accumulation_steps: GradientAccumulation = 1


class BatchingFields(BaseModel):
    """How micro-batches are laid out, grouped and run (speed options)."""

    padding_free: PaddingFree = True
    group_by_length: GroupByLength = False
    compile: Compile = False


class ProcessFields(BaseModel):
    """The worker processes on this machine."""

    nproc_per_node: NprocPerNode = 1
    max_restarts: MaxRestarts = 0

    def world_size(self) -> int:
        return self.nproc_per_node * getattr(self, "nnodes", 1)


class MachinesFields(BaseModel):
    """Several machines: how many, which one this is, and where they meet."""

    nnodes: Nnodes = 1
    node_rank: NodeRank = 0
    rdzv_endpoint: RdzvEndpoint = None
    rdzv_id: RdzvId = "twinkle"

    @model_validator(mode="after")
    def _check_machines(self):
        check_launch(self.nnodes, self.node_rank, self.rdzv_endpoint)
        return self


class DataParallelFields(BaseModel):
    """The Transformers backend's splits over processes: DDP, FSDP (Accelerate or native), HSDP, Ulysses."""

    strategy: StrategyName = Strategy.accelerate
    dp_size: DpSize = 1
    fsdp_size: FsdpSize = None
    sp_size: SpSize = 1


class ModelParallelFields(BaseModel):
    """Splits of the model itself: tensor, pipeline, expert and (megatron) context parallel, sequence-parallel
    activations; and on megatron the layer implementation that computes them, with its fp8 recipe."""

    tp_size: TpSize = 1
    pp_size: PpSize = 1
    ep_size: EpSize = 1
    sequence_parallel: SequenceParallel = False
    cp_size: CpSize = 1
    transformer_impl: TransformerImpl = None
    fp8_recipe: Fp8Recipe = "tensorwise"


class CheckpointFields(BaseModel):
    """Resumable training states: how often one is saved, how many are kept."""

    checkpoint_every: CheckpointEvery = 50
    keep_checkpoints: KeepCheckpoints = 2


class RunFields(BaseModel):
    """Bookkeeping every training flow shares: MLflow experiment, run folders, the time and device budget."""

    experiment_name: ExperimentName = "twinkle"
    output_dir: OutputDir = "runs"
    timeout_minutes: TimeoutMinutes = 120
    device_limit: DeviceLimit = "gpu"


class EvalFields(BaseModel):
    """The before/after answers of the held-out prompts."""

    eval_prompts: EvalPrompts = 3
    max_new_tokens: MaxNewTokens = 40


EvalTasks = Annotated[list[str], Field(description="Benchmarks scored on the base and trained model with "
                      "lm-evaluation-harness: harness task, tag or group names (their data in the local HF datasets "
                      "cache), folders of the harness's YAML tasks, or 'twinkle' (the bundled tasks); empty: none.")]
EvalLimit = Annotated[int | None, Field(ge=1, description="Examples per benchmark task (empty: all).")]
EvalNumFewshot = Annotated[int | None, Field(ge=0, description="Few-shot examples per benchmark question "
                                                              "(empty: each task's own).")]
EvalBatchSize = Annotated[int, Field(ge=1, description="Batch size of the benchmark harness.")]
EvalGenKwargs = Annotated[dict, Field(description="Generation settings for generate_until benchmark tasks, over "
                                                  "the tasks' own, e.g. {\"max_gen_toks\": 64}.")]
EvalChatTemplate = Annotated[Literal["auto", "yes", "no"], Field(
    description="Render benchmark prompts with the run's chat template: auto (the bundled tasks as they say, other "
                "generate_until tasks when the model has a template), yes, no.")]
ChampionMetric = Annotated[str | None, Field(description="A benchmark score that decides the champion, as "
                                                         "bench/TASK/MEASURE (e.g. bench/twinkle_self_cognition/acc); "
                                                         "empty: the flow's own held-out metric.")]


def comma_list(value):
    """A list option given as one string ("twinkle" or "a,b") is the list of its comma-separated parts."""
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


class BenchmarkFields(BaseModel):
    """Standard benchmarks in the evaluate step, through lm-evaluation-harness."""

    eval_tasks: EvalTasks = []
    eval_limit: EvalLimit = None
    eval_num_fewshot: EvalNumFewshot = None
    eval_batch_size: EvalBatchSize = 8
    eval_gen_kwargs: EvalGenKwargs = {}
    eval_chat_template: EvalChatTemplate = "auto"
    champion_metric: ChampionMetric = None
    benchmarks_refused: ClassVar[str | None] = None  # why a flow's models cannot be benchmarked (yet)

    _one_task_is_a_list = field_validator("eval_tasks", mode="before")(comma_list)

    def benchmark_problems(self) -> list[str]:
        """What is wrong before anything runs (the tasks themselves are checked after download, offline)."""
        problems = []
        if self.eval_tasks and self.benchmarks_refused:
            problems.append(f"eval_tasks: {self.benchmarks_refused}")
        if self.eval_tasks and getattr(self, "objective", None) == "vision_lm":
            problems.append("eval_tasks: benchmarks score text-only language models for now; a vision-language "
                            "model would be scored without its images (the harness's multimodal tasks are next)")
        if self.champion_metric is not None:
            parts = self.champion_metric.split("/")
            if len(parts) != 3 or parts[0] != "bench" or not all(parts):
                problems.append(f"champion_metric={self.champion_metric!r}: name a benchmark score as "
                                "bench/TASK/MEASURE, e.g. bench/twinkle_self_cognition/acc")
            elif not self.eval_tasks:
                problems.append(f"champion_metric={self.champion_metric!r} needs eval_tasks: no benchmark runs")
        return problems

    def benchmark_settings(self) -> dict:
        """What the harness worker takes (twinkle_core.evaluate.harness.BenchmarkSettings)."""
        return {"limit": self.eval_limit, "num_fewshot": self.eval_num_fewshot, "batch_size": self.eval_batch_size,
                "gen_kwargs": dict(self.eval_gen_kwargs)}


def check_launch(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    """Catch a wrong multi-machine setting here, not as a rendezvous that waits until it times out."""
    if node_rank >= nnodes:
        raise ValueError(f"node_rank={node_rank} is not below nnodes={nnodes}; give each machine its own "
                         f"node_rank from 0 to {nnodes - 1}, or raise nnodes.")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(f"nnodes={nnodes} needs rdzv_endpoint: set it to HOST:PORT of node 0 (e.g. "
                         "10.0.0.1:29500), the same on every machine.")
    if rdzv_endpoint:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"rdzv_endpoint={rdzv_endpoint!r} is not HOST:PORT; give node 0's address and a free "
                             "port, e.g. 10.0.0.1:29500.")
