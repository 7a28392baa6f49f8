"""Cross-field validation of a composed config, run once in the launching process before any
rank or process group starts. Each rule raises `ConfigError(field, value, problem, fix)`."""
from __future__ import annotations

import copy
import importlib.util

from omegaconf import DictConfig, OmegaConf

from hcp.config.capacity import max_length, tokens_per_rank
from hcp.config.choices import (ATTENTION_BACKENDS, BACKEND_MODULES, ENCODER_ARCHS, FSDP_REDUCE,
                                OPTIMIZERS, PROJECTOR_TYPES, check_cp_backend)
from hcp.config.errors import ConfigError, check_choice
from hcp.config.joins import check_joins
from hcp.config.keys import check_known_keys
from hcp.config.layouts import check_layouts
from hcp.config.modules import (check_graph, encoder_names, module_cfg, module_key, module_names,
                                streams)
from hcp.config.precision import PRECISIONS
from hcp.config.te_rules import check_te

_CHOICES = {  # placement, packing, cp_comm and recompute: hcp.config.layouts
    "mode": ("train", "plan", "export", "calibrate", "rehearse"),
    "layout": ("manual", "auto"),
    "export.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.long_docs": ("split", "truncate", "reject"),
    "precision": PRECISIONS,
    "logger.name": ("wandb", "none"),
    # wandb's Settings.mode
    "logger.mode": ("offline", "online", "disabled", "shared", "dryrun", "run"),
    "data.on_error": ("error", "skip"),
    "trainer.plan_share": ("node", "rank"),
    "launcher.backend": ("auto", "nccl", "gloo"),
    "launcher.start_method": ("auto", "fork", "spawn", "forkserver"),
    "llm.attention_backend": ATTENTION_BACKENDS,
    "optim.name": OPTIMIZERS,
    "projector.type": PROJECTOR_TYPES,
    "trainer.fsdp_reduce": FSDP_REDUCE,
}


def check_choices(cfg) -> None:
    for key, allowed in _CHOICES.items():
        if key.split(".")[0] in ("projector",) and cfg.get("projector") is None:
            continue
        if key == "logger.mode" and cfg.logger.name != "wandb":  # read by wandb only
            continue
        check_choice(key, OmegaConf.select(cfg, key), allowed)
    if cfg.data.name == "code_corpus" and cfg.data.long_docs == "reject":
        raise ConfigError("data.long_docs", "reject", "data=code_corpus reads whole source files, "
                          "many longer than any max_seq_len",
                          "use data.long_docs=split or truncate")


def check_rehearse_report(cfg) -> None:
    """`rehearse.report` is read by `layout=auto` only (its memory estimates of the layouts it
    searches): under `layout=manual` it would be ignored, so it is refused."""
    if cfg.rehearse.get("report") is not None and cfg.layout != "auto":
        raise ConfigError("rehearse.report", cfg.rehearse.report,
                          "only layout=auto reads it (a rehearsal's "
                          "tracked peaks correcting the memory estimates of the layouts it "
                          "searches); a manual layout is rehearsed itself (mode=rehearse writes "
                          "its own rehearsal.json into the run directory, its tracked peaks beside "
                          "plan mode's estimates)",
                          "add layout=auto, or drop rehearse.report")


def check_backends(cfg, layouts) -> None:
    """An optional GPU backend asked for by name must run with the largest CP group of the run
    (`check_cp_backend`: under `packing=dynamic_cp` the LLM's CP pool) and be importable
    (checked without importing it: `import transformer_engine` raises on machines without CUDA),
    and `te` must be one the installed Transformer Engine runs (`hcp.config.te_rules`)."""
    backend, llm, dynamic = cfg.llm.attention_backend, layouts["llm"], cfg.packing == "dynamic_cp"
    cp = llm.cp_pool if dynamic else llm.cp
    check_cp_backend(backend, cp, dynamic)
    if backend in BACKEND_MODULES:
        package, how = BACKEND_MODULES[backend]
        package = package.split(".")[0]
        if importlib.util.find_spec(package) is None:
            raise ConfigError("llm.attention_backend", backend, f"the `{package}` package is not "
                              "installed", f"{how}, or set llm.attention_backend=auto")
    check_te(backend, cfg.precision, cp, llm.cp_comm)


def check_model(cfg) -> None:
    v = cfg.vision
    if (v is None) != (cfg.projector is None):
        raise ConfigError("projector", cfg.projector,
                          "vision and projector must both be set or both "
                          "be null",
                          "set both (LLaVA) or `vision: null` and `projector: null` (text LM)")
    check_graph(cfg)
    for m in encoder_names(cfg):
        key, e = ("vision" if m == "vision" else f"encoders.{m}"), module_cfg(cfg, m)
        check_choice(f"{key}.arch", e.arch, ENCODER_ARCHS)
        if e.image_size % e.patch_size:
            raise ConfigError(f"{key}.patch_size", e.patch_size,
                              f"does not divide {key}.image_size="
                              f"{e.image_size}", "pick a patch size that divides the image size")
    for s in streams(cfg.graph.edges):
        key = "projector" if s.projector == "projector" else f"projectors.{s.projector}"
        p, e = module_cfg(cfg, s.projector), module_cfg(cfg, s.encoder)
        check_choice(f"{key}.type", p.type, PROJECTOR_TYPES)
        side = e.image_size // e.patch_size
        if p.pool < 1 or side % p.pool:
            raise ConfigError(f"{key}.pool", p.pool,
                              f"must divide the {side} x {side} patch grid of "
                              f"{s.encoder}",
                              f"use a pool in {[d for d in range(1, side + 1) if side % d == 0]}")
    present = module_names(cfg)
    if all(module_cfg(cfg, m).freeze for m in present):
        raise ConfigError("llm.freeze", True,
                          f"every module ({', '.join(sorted(present))}) is frozen: "
                          "nothing would train",
                          "unfreeze one, e.g. llm.freeze=false or +stage=pretrain")


def _check_optim(cfg) -> None:
    """`optim.lr` > 0 and `optim.weight_decay` >= 0, and the same for every module's own
    `<module>.optim.lr` / `weight_decay` (named modules by their config path)."""
    blocks = [("optim", cfg.optim)]
    for m in module_names(cfg):
        block = module_cfg(cfg, m)
        if block is not None and block.get("optim") is not None:
            blocks.append((f"{module_key(cfg, m)}.optim", block.optim))
    for path, block in blocks:
        lr, wd = block.get("lr"), block.get("weight_decay")
        if lr is not None and lr <= 0:
            raise ConfigError(f"{path}.lr", lr, "must be > 0", f"use e.g. {path}.lr=1e-3")
        if wd is not None and wd < 0:
            raise ConfigError(f"{path}.weight_decay", wd, "must be >= 0",
                              f"use e.g. {path}.weight_decay=0.0")


def check_trainer(cfg, layouts) -> None:
    t = cfg.trainer
    for key in ("max_steps", "global_batch_size", "micro_batch_tokens", "log_every"):
        if t[key] < 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be >= 1", "use a positive value")
    for key, value, zero in (("trainer.eval_every", t.eval_every, "only at the end"),
                             ("trainer.save_every", t.save_every, "only at the end"),
                             ("trainer.eval_samples", t.eval_samples, "the whole held-out split"),
                             ("trainer.grad_clip", t.grad_clip, "no clipping"),
                             ("checkpoint.keep", cfg.checkpoint.keep, "keep every checkpoint"),
                             ("data.images_per_sample", cfg.data.images_per_sample, "text only")):
        if value < 0:
            raise ConfigError(key, value, f"must be >= 0 (0: {zero})", "use 0 or a positive value")
    for key, example in (("warmup_ratio", 0.03), ("min_lr_ratio", 0.0)):
        if not 0 <= cfg.optim[key] <= 1:
            raise ConfigError(f"optim.{key}", cfg.optim[key], "must be in [0, 1] (a fraction)",
                              f"use e.g. optim.{key}={example}")
    if cfg.data.max_seq_len < 1:
        raise ConfigError("data.max_seq_len", cfg.data.max_seq_len, "must be >= 1 (the longest "
                          "sample in tokens)", "use a positive value, e.g. data.max_seq_len=512")
    cap = t.get("eval_max_new_tokens")
    if cap is not None and cap < 1:
        raise ConfigError("trainer.eval_max_new_tokens", cap,
                          "greedy evaluation must decode at least "
                          "one token",
                          "use null (the longest reference answer plus EOS) or a value >= 1")
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError("data.eval_fraction", cfg.data.eval_fraction, "must be in [0, 1)",
                          "use e.g. data.eval_fraction=0.15")
    _check_optim(cfg)
    _check_long_runs(cfg)
    if cfg.mode != "calibrate":  # calibrate reads no data: its own grid check (`check_cap`) rules
        check_longest_sample(cfg, layouts["llm"])


def _check_long_runs(cfg) -> None:
    """`profile.steps` within the run; `trainer.straggler_factor`, `trainer.loss_spike_factor`
    and `trainer.max_skipped_steps` in range (docs/long_runs.md)."""
    t, steps = cfg.trainer, cfg.profile.steps
    if steps is not None and not (1 <= len(steps) <= 2
                                  and 1 <= steps[0] <= steps[-1] <= t.max_steps):
        raise ConfigError("profile.steps", list(steps), "must be [first, last] or [step] with 1 <= "
                          f"first <= last <= trainer.max_steps={t.max_steps}",
                          "use e.g. 'profile.steps=[10,12]'")
    for key, what, example in (("straggler_factor", "the median rank's time per step", 2.0),
                               ("loss_spike_factor", "the recent mean loss", 5.0)):
        if t[key] != 0 and t[key] <= 1:
            raise ConfigError(f"trainer.{key}", t[key], "must be 0 (off) or above 1 (a multiple "
                              f"of {what})", f"use e.g. trainer.{key}={example}")
    if t.max_skipped_steps is not None and t.max_skipped_steps < 0:
        raise ConfigError("trainer.max_skipped_steps", t.max_skipped_steps, "must be >= 0 or null "
                          "(no limit)", "use e.g. trainer.max_skipped_steps=10")


def check_longest_sample(cfg, llm) -> None:
    """`trainer.micro_batch_tokens` is a per-rank capacity: the longest sample (`data.max_seq_len`)
    may span the LLM's CP group, under `packing=dynamic_cp` the whole CP pool (dp * cp ranks),
    and on c > 1 ranks it is padded to a multiple of 2c (head-tail sharding), so it must fit
    `hcp.config.capacity.max_length(c, micro_batch_tokens)` (the planner's own limit)."""
    tokens, longest = cfg.trainer.micro_batch_tokens, cfg.data.max_seq_len
    dynamic = cfg.packing == "dynamic_cp"
    span = llm.cp_pool if dynamic else llm.cp
    limit = max_length(span, tokens)
    if longest > limit:
        where = (f"the dynamic-CP pool of dp*cp = {llm.dp}*{llm.cp} = {span} ranks" if dynamic
                 else f"llm.layout.cp={span} ranks")
        pad = ", head-tail padding to a multiple of 2*cp counted" if span > 1 else ""
        raise ConfigError(
            "trainer.micro_batch_tokens", tokens,
            f"{where} at this many tokens per rank holds a sample of at most {limit} "
            f"tokens{pad}, less than data.max_seq_len={longest}",
            f"use trainer.micro_batch_tokens >= {tokens_per_rank(longest, span)}, or "
            f"data.max_seq_len <= {limit}, or a larger "
            f"{'CP pool (llm.layout.dp * llm.layout.cp)' if dynamic else 'llm.layout.cp'}")


def validate(cfg, world_size: int, unresolved=None) -> dict:
    """Run every rule on `cfg` for `world_size` ranks; return the resolved layouts
    ({module: `hcp.config.layouts.ResolvedLayout`}).

    A fix that offers values of a field (`use llm.layout.tp in [1, 2]`) offers only those with
    which the whole config passes every rule. `unresolved` is `cfg` before its interpolations
    were resolved: keys that follow the field (the tiny LLaVA's `vision.layout.tp:
    ${llm.layout.tp}`) then take each tried value too, as they would on the command line.

    Raises:
        ConfigError: the first rule broken, naming the field, the value and a fix (a key the
            schema does not declare names the closest one).
    """
    try:
        return _validate(cfg, world_size)
    except ConfigError as e:
        if not e.candidates:
            raise
        followers = _followers(unresolved, e.field) if unresolved is not None else []
        passing, blocked = [], None
        for value in e.candidates:
            trial = copy.deepcopy(cfg)
            for key in [e.field, *followers]:
                OmegaConf.update(trial, key, value, merge=False)
            try:
                _validate(trial, world_size)
                passing.append(value)
            except ConfigError as other:
                blocked = blocked or other
        raise e.narrowed(passing, blocked) from None


def _followers(cfg, key: str) -> list[str]:
    """Dotted keys of `cfg` (unresolved) whose value is the plain interpolation `${key}`, or
    `${k}` of such a follower k (transitively)."""
    links = []

    def walk(node, prefix):
        for k in node:
            child, path = node._get_node(k), f"{prefix}{k}"
            if isinstance(child, DictConfig):
                if not child._is_none() and not child._is_interpolation():
                    walk(child, path + ".")
            elif child._is_interpolation():
                links.append((path, str(child._value())))

    walk(cfg, "")
    found, todo = [], [key]
    while todo:
        target = "${" + todo.pop() + "}"
        new = [path for path, ref in links if ref == target and path not in found]
        found += new
        todo += new
    return found


def _validate(cfg, world_size: int) -> dict:
    """`validate`'s rules, in order, without narrowing a fix's values."""
    check_known_keys(cfg)
    check_choices(cfg)
    check_rehearse_report(cfg)
    check_model(cfg)
    layouts = check_layouts(cfg, world_size)
    check_backends(cfg, layouts)
    check_joins(cfg, layouts)
    check_trainer(cfg, layouts)
    return layouts
