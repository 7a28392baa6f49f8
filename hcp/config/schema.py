"""Structured configs: the typed schema behind every YAML file and CLI override.

Registered in Hydra's ConfigStore as `base_config`; `conf/config.yaml` lists it first in its
defaults, so a misspelled key or a wrong type fails at composition, before any rank starts.
Cross-field rules live in `hcp.config.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class LayoutConfig:
    """A module's parallel sizes (docs/design.md: layout). Grid axis order: tp, cp, dp, pp
    (slowest)."""

    tp: int = 1
    """Tensor-parallel size."""
    cp: int = 1
    """Context-parallel size (head-tail chunks of every document)."""
    pp: int = 1
    """Pipeline-parallel stages."""
    dp: int = -1
    """Data-parallel size; -1 infers it from the module's rank count."""
    num_ranks: Optional[int] = None
    """Island size in ranks (non_colocated only); None: inferred from the other modules."""
    rank_offset: Optional[int] = None
    """First rank of the module's island (non_colocated); None: derived in graph order."""
    cp_comm: str = "allgather"
    """CP attention strategy: `allgather` (K/V gathered once) or `p2p` (ring)."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along tokens over TP (Megatron sequence parallelism)."""
    pp_layers: Optional[list[int]] = None
    """Explicit layers per PP stage, e.g. [10, 12, 12, 6]; None: an even split."""
    dp_shard: bool = False
    """Shard parameters, gradients and optimizer state over DP x CP with FSDP2."""
    recompute: str = "none"
    """Activation recompute: `none`, `selective` (attention) or `full`."""


@dataclass
class ModuleOptimConfig:
    """A module's own optimizer settings (`vision.optim`, `projector.optim`, `llm.optim`): its
    parameters form their own AdamW parameter groups (`<module>.decay`, `<module>.no_decay`),
    e.g. LLaVA's lower learning rate for a fine-tuned vision tower (`vision.optim.lr=2e-6`,
    its `mm_vision_tower_lr`) or a projector without weight decay. Unset fields use `optim.*`;
    the warmup and cosine schedule scale every group's peak alike. On resume this config's
    values win over the checkpoint's (the log says what changed). hcp.train.optim."""

    lr: Optional[float] = None
    """Peak learning rate of this module; None: `optim.lr`."""
    weight_decay: Optional[float] = None
    """Weight decay of this module's weight matrices (norms, biases and embeddings never
    decay); None: `optim.weight_decay`."""


@dataclass
class VisionConfig:
    """ViT image encoder (CLIP-style: patch embedding, CLS token, pre-norm blocks)."""

    image_size: int = 8
    """Input resolution in pixels (images are resized to it)."""
    patch_size: int = 2
    num_channels: int = 1
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 256
    select_layer: int = -1
    """Hidden state fed to the projector: -1 last block, -2 penultimate (LLaVA's choice)."""
    norm_eps: float = 1e-5
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    freeze: bool = False
    optim: ModuleOptimConfig = field(default_factory=ModuleOptimConfig)
    """This module's own learning rate / weight decay (`ModuleOptimConfig`)."""
    init_from: Optional[str] = None
    """A local Hugging Face CLIP checkpoint folder (config.json + safetensors); its architecture
    fields replace this block's (a conflicting command-line value is an error)."""
    arch: str = "vit"
    """The encoder type (`hcp.model.encoder_types.ENCODERS`): `vit` (the tiny default: GELU
    MLP) or `clip` (OpenAI CLIP: quick-GELU MLP)."""


@dataclass
class ProjectorConfig:
    """LLaVA projector from vision width to LLM width."""

    type: str = "mlp2x_gelu"
    """`mlp2x_gelu` (Linear GELU Linear, LLaVA-1.5) or `linear`."""
    pool: int = 1
    """Average-pool the encoder's patch grid over `pool` x `pool` windows before projecting:
    (image_size / patch_size / pool)^2 rows per image instead of one per patch (a summary
    stream, e.g. the pooled branch of one vision tower feeding two projectors)."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    freeze: bool = False
    optim: ModuleOptimConfig = field(default_factory=ModuleOptimConfig)
    """This module's own learning rate / weight decay (`ModuleOptimConfig`)."""


@dataclass
class LLMConfig:
    """LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    vocab_size: int = 264
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_backend: str = "auto"
    """`auto` (fastest installed), `torch` (pure torch, CPU reference), `te`, `flash`."""
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    freeze: bool = False
    optim: ModuleOptimConfig = field(default_factory=ModuleOptimConfig)
    """This module's own learning rate / weight decay (`ModuleOptimConfig`)."""
    init_from: Optional[str] = None
    """A local Hugging Face LLaMA checkpoint folder (config.json + safetensors, one file or
    sharded with its index); its architecture fields replace this block's (a conflicting
    command-line value is an error)."""


@dataclass
class GraphConfig:
    """The module graph: directed edges src -> dst."""

    edges: list[list[str]] = field(default_factory=lambda: [["vision", "projector"],
                                                            ["projector", "llm"]])


@dataclass
class TrainerConfig:
    max_steps: int = 300
    global_batch_size: int = 32
    """Samples per optimizer step, over all DP ranks."""
    micro_batch_tokens: int = 4096
    """THD capacity per rank and micro-batch, in tokens."""
    log_every: int = 10
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    eval_samples: int = 0
    """Held-out samples to evaluate (0: the whole held-out split)."""
    eval_max_new_tokens: Optional[int] = None
    """Greedy decoding's cap in tokens for `eval/answer_accuracy`; None: the longest reference
    answer of the evaluated samples plus its EOS (hcp.train.evaluate.answer_tokens)."""
    grad_clip: float = 1.0
    """Max global gradient L2 norm (0 disables clipping)."""
    progress_bar: bool = True
    on_nonfinite: str = "stop"
    """A NaN/Inf loss or gradient norm: `stop` (raise, naming the step; no checkpoint is written)
    or `skip` (drop that step's update, count it and go on). hcp.train.failures."""
    check_plan: bool = True
    """All-reduce a 64-bit checksum of every step's plan (one int64 all-reduce per step, before
    the step's collectives) and stop every rank with one error naming the step when they
    computed different plans, which would otherwise hang a collective. hcp.train.plan_check."""
    max_skipped_steps: Optional[int] = 10
    """Under `on_nonfinite=skip`: the most steps a run may skip; the next non-finite step stops
    it as `stop` does, naming the step and its global batch (null: no limit).
    hcp.train.failures.NonFiniteGuard."""
    loss_spike_factor: float = 0.0
    """A finite loss above this factor times the mean of the previous 20 steps' is said in one
    line naming the step and its global batch; training goes on (0: off). hcp.train.failures."""
    straggler_factor: float = 2.0
    """Every `log_every` steps, a rank whose compute + data-wait time per step is above this
    factor times the median rank's is named in one line (0: off). hcp.train.stragglers."""
    check_counts: bool = False
    """Debug: count the step's loss tokens with a collective too and check the plan's counts,
    which the step otherwise takes as they are (no collective). hcp.plan.step."""
    plan_process: Optional[bool] = None
    """Under `packing=dynamic_cp`: compute each next step's plan in a spawned worker process
    (hcp/plan/ahead.py), not on a thread of the training process, where the solver's pure
    Python holds the GIL in turns with the training thread. The worker starts with the trainer
    and imports torch and the run's modules once, behind the model's set-up. Default (null): on
    for CUDA ranks, off for CPU ranks (`hcp.plan.ahead.use_worker`). hcp.train.planner."""
    plan_share: str = "node"
    """Under `packing=dynamic_cp`, who runs the solver: `node` (each node's local rank 0 plans
    and publishes the plan in the run directory; the node's other ranks read it, no collective)
    or `rank` (every rank plans the same plan itself). hcp.plan.shared."""
    fsdp_reduce: str = "per_micro_batch"
    """When a `dp_shard` module reduce-scatters its gradients: `per_micro_batch` (every backward;
    a rank holds only its gradient shard) or `per_step` (the last backward only: one
    reduce-scatter per step, but every micro-batch's whole fp32 gradient held until then).
    docs/memory.md."""


@dataclass
class ProfileConfig:
    """Look inside chosen steps (hcp.train.profile)."""

    steps: Optional[list[int]] = None
    """`[first, last]` (1-based, inclusive; `[k]`: one step): a `torch.profiler` trace of those
    steps per rank in `<run dir>/profile/` (Chrome trace JSON: Perfetto, TensorBoard)."""
    memory: bool = False
    """With `steps`: CUDA's memory snapshot of those steps per rank (`_record_memory_history`,
    `_dump_snapshot`; open it at pytorch.org/memory_viz). None on CPU ranks."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """`adamw` (hcp.config.choices.OPTIMIZERS)."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    """Decoupled weight decay on weight matrices only (linear and projection weights); norms,
    biases and embeddings (token, patch, position, CLS) never decay, as in Megatron-LM and LLaVA."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_ratio: float = 0.03
    """Linear warmup as a fraction of `trainer.max_steps` (LLaVA: 3%)."""
    min_lr_ratio: float = 0.0
    """Cosine decays to `lr * min_lr_ratio`."""


@dataclass
class DataConfig:
    name: str = "digits_vqa"
    """`digits_vqa` (built in), `llava_json` (your data), `code_corpus` (stdlib sources) or
    `tokens` (your Megatron .bin/.idx or JSONL text, blended); `digits_pair` (built in, two
    encoders: `vision` and `vision2` each read one digit, hcp.data.digits); `digits_tiles`
    (built in: a thumbnail plus 1-4 tiles per scan, InternVL-style tiling)."""
    path: Optional[str] = None
    """LLaVA conversation JSON (data=llava_json)."""
    image_folder: Optional[str] = None
    """Folder that the records' `image` paths are relative to."""
    eval_path: Optional[str] = None
    """Held-out LLaVA JSON; None: no held-out evaluation for llava_json."""
    root: str = "${oc.env:HCP_DATA_DIR,${oc.env:HOME,/tmp}/.cache/hcp}"
    """Cache folder for built-in data sets."""
    tokenizer: str = "byte"
    """`byte` (nothing to download) or a path to a Hugging Face `tokenizer.json`."""
    max_seq_len: int = 256
    """Longest sample in tokens after `<image>` expansion."""
    images_per_sample: float = 1.0
    """Plan mode: images (or tiles) per sample that the encoder's memory estimate assumes
    (LLaVA-1.5: 1; dynamic high-resolution tiling: the mean tile count). Training counts the
    real images."""
    system_prompt: str = ""
    """Vicuna-v1 system prompt; LLaVA-1.5 uses a long one, the tiny recipe none."""
    on_error: str = "error"
    """Bad records: `error` (stop, naming file and id) or `skip` (count and report)."""
    eval_fraction: float = 0.15
    """Held-out fraction of a built-in data set."""
    sources: Optional[list[Any]] = None
    """data=tokens: `[{path, weight}]`, each a Megatron indexed data set (`PREFIX` of
    PREFIX.bin / PREFIX.idx) or a `.jsonl` file; samples are drawn in proportion to the weights."""
    long_docs: str = "split"
    """A document longer than `max_seq_len`: `split` into max_seq_len pieces, `truncate` to its
    first piece (data=tokens, code_corpus), or `reject` (data=tokens: an error naming the file
    and document)."""
    text_key: str = "text"
    """data=tokens: the JSONL field holding a document's text."""


@dataclass
class LoggerConfig:
    name: str = "wandb"
    """`wandb` or `none`. The console summary and metrics.jsonl are always written."""
    project: str = "hcp"
    entity: Optional[str] = None
    mode: str = "${oc.env:WANDB_MODE,offline}"


@dataclass
class SlurmConfig:
    """SLURM job settings for `python -m hcp.launch.sbatch` and `hydra/launcher=submitit_slurm`
    (docs/launching.md). Nodes and tasks per node are `launcher.nnodes` / `nproc_per_node`."""

    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    gpus_per_node: Optional[int] = None
    """GPUs to request per node (None: none, a CPU job); must equal launcher.nproc_per_node."""
    cpus_per_task: Optional[int] = None
    time_min: int = 60
    """Job time limit in minutes."""
    signal: str = "USR2"
    """Signal SLURM sends `signal_lead_s` before the time limit (`--signal=USR2@N`): save and
    requeue. Only `USR2`: SIGTERM (scancel) means save and stop, never requeue."""
    signal_lead_s: int = 120
    """Seconds before the time limit that the signal comes: must cover a step plus a checkpoint
    (also how long `python train.py`'s launcher lets ranks save after a SIGTERM before it
    terminates them, `hcp.launch.supervise`)."""
    max_requeues: int = 3
    """Times a job requeues itself after `signal` (SLURM_RESTART_COUNT), then it stops."""
    requeue_exit_code: int = 85
    """Exit code when `scontrol` is missing: requeues only where slurm.conf has RequeueExit=85."""
    launch: str = "srun"
    """sbatch path: `srun` (one task per GPU) or `torchrun` (one per node, c10d rendezvous)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job runs before launching (module load, activating an environment)."""


@dataclass
class LauncherConfig:
    nproc_per_node: Any = "auto"
    """Ranks per node: `auto` = one per GPU on CUDA, 4 on CPU; or an int."""
    nnodes: int = 1
    start_method: str = "auto"
    """Local rank start method: `auto` (spawn when CUDA devices are visible, else fork), `fork`
    (fast on CPU; refused with CUDA unless backend=gloo), `spawn` or `forkserver`.
    hcp.launch.launch.local_start_method."""
    backend: str = "auto"
    """`auto` (nccl on CUDA, gloo on CPU), `nccl` or `gloo`."""
    timeout_s: int = 600
    """Collective timeout in seconds: a stuck collective fails instead of hanging."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)


@dataclass
class CheckpointConfig:
    dir: str = "${hydra:runtime.output_dir}/checkpoints"
    keep: int = 2
    """Checkpoints kept; older ones are pruned (0: keep every one)."""
    # `checkpoint.async` is a Python keyword: declared through the class namespace, outside
    # __init__ and __repr__ (OmegaConf types and merges it like any field).
    __annotations__["async"] = bool
    locals()["async"] = field(default=False, init=False, repr=False, compare=False)
    """Write checkpoints in the background (torch DCP `async_save`): training goes on while a
    save is written; the next save and the end of the run wait for it (docs/checkpoints.md)."""


@dataclass
class ExportConfig:
    dir: Optional[str] = None
    """mode=export: folder to write `llm/` (LlamaForCausalLM), `vision/` (CLIPVisionModel) and
    `mm_projector.bin` (LLaVA-1.5 names) into."""
    dtype: str = "auto"
    """`auto` (the init_from checkpoint's dtype, else float32), `float32`, `bfloat16`, `float16`."""


@dataclass
class ClusterConfig:
    """The target machine for plan mode and memory checks."""

    num_nodes: int = 1
    gpus_per_node: int = 8
    device_memory_gib: float = 80.0


@dataclass
class RehearseConfig:
    """`mode=rehearse`: every rank of the job's full world runs the real training code on a
    recording fake process group (hcp.preflight.rehearse)."""

    steps: int = 2
    """Training steps each rank runs."""
    ranks: Optional[list[int]] = None
    """Ranks to rehearse, for a quick look; None: all of them (only that proves the job)."""
    jobs: Optional[int] = None
    """Ranks rehearsed at a time, one process each; None: one per CPU core."""
    by_class: bool = False
    """Rehearse one rank per class and derive the others' traces (hcp.preflight.rehearse.classes);
    every check runs on the whole world."""
    device: str = "cpu"
    """`cpu`: the ranks run on fake CPU tensors; `cuda`: on fake CUDA tensors (the CUDA code
    path, autocast included), with every device read, host-to-device copy, device mismatch and
    attention kernel recorded and checked (hcp.preflight.rehearse.device; docs/rehearsal.md)."""
    report: Optional[str] = None
    """An input of `layout=auto` (refused without it): a `rehearsal.json` of this job (its world
    size, precision, micro-batch tokens and model, which the file records), by whose largest
    tracked / plan ratio, when above 1, it multiplies its memory estimates (the estimate
    corrected by the real ops' peak). A rehearsal writes its own into its run directory."""


@dataclass
class HCPConfig:
    seed: int = 1234
    mode: str = "train"
    """`train`, `plan` (one process, no process groups: layouts, memory, plan.json/png),
    `export` (write the model as the run would start it as a Hugging Face checkpoint) or
    `calibrate` (fit the dynamic-CP cost model on this machine: hcp/preflight/calibrate.py) or
    `rehearse` (every rank of the full world through the real training code on a recording
    fake process group; checks collectives, sends/receives, group creation, memory:
    hcp/preflight/rehearse)."""
    placement: str = "colocated"
    """`colocated` or `non_colocated`."""
    layout: str = "manual"
    """`manual` (every module's `layout` as configured) or `auto`: search placement, island
    sizes and every module's layout for the fastest estimated step; fields set on the command
    line stay fixed (hcp.preflight.auto_layout)."""
    packing: str = "first_fit"
    """`first_fit` or `dynamic_cp`."""
    precision: str = "fp32"
    """`fp32` or `bf16` (bf16 compute, fp32 master weights and gradient reduction)."""
    resume: Optional[str] = None
    """None, `auto` (latest checkpoint in checkpoint.dir) or a checkpoint path."""
    vision: Optional[VisionConfig] = field(default_factory=VisionConfig)
    projector: Optional[ProjectorConfig] = field(default_factory=ProjectorConfig)
    llm: LLMConfig = field(default_factory=LLMConfig)
    encoders: Dict[str, VisionConfig] = field(default_factory=dict)
    """More encoder modules by name, each with its own architecture and layout (a second vision
    tower, a second modality), e.g. `+encoder@encoders.vision2=vit_tiny`; `graph.edges` wires
    each to its projector(s). Samples give it inputs under the record key `<name>` and the
    text placeholder `<name>` (hcp.data.llava). hcp.config.modules."""
    projectors: Dict[str, ProjectorConfig] = field(default_factory=dict)
    """More projector modules by name, e.g. `+projectors={projector2:{}}`, each fed by one
    encoder and feeding the LLM (`graph.edges`); its rows fill its own placeholders."""
    graph: GraphConfig = field(default_factory=GraphConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    init_from_checkpoint: Optional[str] = None
    """Start a new stage from a checkpoint folder: model weights only, a fresh optimizer and
    schedule at step 0 (LLaVA stage 2 from stage 1). `resume` continues the same run."""
    export: ExportConfig = field(default_factory=ExportConfig)
    rehearse: RehearseConfig = field(default_factory=RehearseConfig)
    packing_profile: str = "h100"
    """Hardware profile of the dynamic-CP cost model: `h100` (analytic defaults,
    hcp/dcp/profiles/h100.yaml) or a YAML file, e.g. the `profile.yaml` of `mode=calibrate`."""


MODULES = ("vision", "projector", "llm")
"""Module keys in graph order."""


def register() -> None:
    """Register the schema with Hydra's ConfigStore as `base_config`, and the recipes of
    `recipes/` as the group `recipe` (`hcp.config.recipes`)."""
    from hydra.core.config_store import ConfigStore

    from hcp.config.recipes import register_recipes

    ConfigStore.instance().store(name="base_config", node=HCPConfig)
    register_recipes()
