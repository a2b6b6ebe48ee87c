"""Upstream names: how distopt's hyperparameters, states and step counts appear in the state_dict and
param_groups of the upstream PyTorch class each optimizer reproduces (docs/python.md, docs/optimizers.md).

One table per optimizer:
  group:   (distopt key, upstream param_groups key, index into an upstream tuple or None). distopt keys not
           listed keep their name. On input both spellings are accepted (betas=(0.9, 0.99) or beta1=0.9).
  ignore:  upstream param_groups keys with no distopt equivalent and no effect on the result on the CPU
           (kernel selection): dropped on input.
  fixed:   upstream keys distopt implements for one value only: accepted with that value, an error otherwise.
  states:  distopt state name -> upstream state key, where they differ (every reference optimizer already
           names its states as upstream does, so these are empty; docs/optimizers.md).
  step:    how upstream stores a parameter's step count: "tensor" (a float32 0-d tensor, torch.optim.AdamW since
           torch 1.12) or "int"; step_optional: upstream leaves it out for some parameters (read as 0).
  bools:   distopt enum keys whose "true"/"false" upstream spells as a Python bool (muon's use_muon).
  defaults: the upstream class's group keys that do not change the computation (torch.optim.AdamW's foreach,
           maximize, capturable, differentiable, fused), in every param_groups entry at upstream's defaults
  drop:    per-parameter state keys upstream writes as diagnostics of the last step (not read by its next
           step): ignored on load (torch_optimizer.Lamb's and ColossalAI's weight_norm, adam_norm, trust_ratio).
  group_states, group_step, group_mode: what upstream keeps per param group that distopt keeps per parameter
           (schedulefree: {distopt state: group key}, the step as the group's clock k, train mode as a bool):
           a state_dict carries them in each group (from its first parameter with state) and a loaded one
           that lacks them per parameter takes the group's.
Optimizers without an entry use distopt's names and an int step.
"""

TABLE = {
    "adamw": {  # torch.optim.AdamW
        "group": [("lr", "lr", None), ("beta1", "betas", 0), ("beta2", "betas", 1), ("eps", "eps", None),
                  ("weight_decay", "weight_decay", None), ("amsgrad", "amsgrad", None)],
        "ignore": ("foreach", "capturable", "differentiable", "fused"),
        "fixed": {"maximize": False, "decoupled_weight_decay": True},  # (the latter: torch >= 2.6's AdamW key)
        "defaults": {"foreach": None, "maximize": False, "capturable": False, "differentiable": False,
                     "fused": None, "decoupled_weight_decay": True},
        "states": {},
        "step": "tensor",
    },
    "adafactor": {  # transformers.optimization.Adafactor
        "group": [("lr", "lr", None), ("eps1", "eps", 0), ("eps2", "eps", 1),
                  ("clip_threshold", "clip_threshold", None), ("decay_rate", "decay_rate", None),
                  ("beta1", "beta1", None), ("weight_decay", "weight_decay", None),
                  ("scale_parameter", "scale_parameter", None), ("relative_step", "relative_step", None),
                  ("warmup_init", "warmup_init", None)],
        "ignore": (),
        "fixed": {},
        "states": {},
        "step": "int",
    },
    "came": {  # came_pytorch.CAME
        "group": [("lr", "lr", None), ("eps1", "eps", 0), ("eps2", "eps", 1),
                  ("clip_threshold", "clip_threshold", None), ("beta1", "betas", 0), ("beta2", "betas", 1),
                  ("beta3", "betas", 2), ("weight_decay", "weight_decay", None)],
        "ignore": (),
        "fixed": {},
        "states": {},
        "step": "int",
    },
    "lamb": {  # colossalai.nn.optimizer.Lamb (torch_optimizer.Lamb's state_dict loads too)
        "group": [("beta1", "betas", 0), ("beta2", "betas", 1)],
        "ignore": (),
        "fixed": {},
        "states": {},
        "step": "int",
        "drop": ("weight_norm", "adam_norm", "trust_ratio"),
    },
    "torch_adafactor": {  # torch.optim.Adafactor (torch >= 2.5)
        "group": [("lr", "lr", None), ("beta2_decay", "beta2_decay", None), ("eps1", "eps", 0), ("eps2", "eps", 1),
                  ("d", "d", None), ("weight_decay", "weight_decay", None)],
        "ignore": ("foreach",),
        "fixed": {"maximize": False},
        "defaults": {"foreach": None, "maximize": False},
        "states": {},
        "step": "tensor",
    },
}
# schedulefree 1.4.1's AdamWScheduleFree: betas; its group keeps the clock and the average's weights (k, weight_sum,
# lr_max, scheduled_lr, train_mode): read by distopt per parameter (its states weight_sum, lr_max and its step),
# dropped on input; no per-parameter step upstream (read as 0)
TABLE["adamw_schedulefree"] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)],
                               "ignore": ("foreach", "k", "train_mode", "weight_sum", "lr_max", "scheduled_lr"),
                               "fixed": {}, "states": {}, "step": "int", "step_optional": True,
                               "group_states": {"weight_sum": "weight_sum", "lr_max": "lr_max"},
                               "group_step": "k", "group_mode": "train_mode"}
# adam-mini 1.1.1's Adam_mini: one group per parameter, beta1/beta2 as group keys (distopt's names), its "name"
# read into block/head_numel (_adam_mini_group); betas=(...) as distopt.Optimizer writes them
TABLE["adam_mini"] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)], "ignore": (), "fixed": {}, "states": {},
                      "step": "int", "drop": ("head_per_gpu", "neuron_per_gpu", "block_numel", "reduced")}
# pytorch-optimizer 4.1.0's NorMuon: its AdamW groups' betas; use_muon a bool; the group clock "step" (per
# parameter here; a loaded state_dict takes it from the group); ns_coeffs read by _normuon
TABLE["normuon"] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)], "ignore": ("foreach", "step"),
                    "fixed": {}, "states": {}, "step": "int", "step_optional": True, "group_step": "step",
                    "bools": ("use_muon",)}
# pytorch-optimizer 4.1.0's SOAP: betas; the group clock "step" (per parameter here, as NorMuon's); its lists GG and
# Q recorded as GG0, GG1, ... and Q0, Q1, ...; a parameter's copies of the group's precondition_frequency and
# shampoo_beta are not state
TABLE["soap"] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)], "ignore": ("step",), "fixed": {},
                 "states": {}, "step": "int", "step_optional": True, "group_step": "step",
                 "drop": ("precondition_frequency", "shampoo_beta")}
# muon-optimizer 0.1.0 (SingleDeviceMuonWithAuxAdam): use_muon a bool (distopt's enum true/false; auto stays a
# string), betas for the aux Adam groups, and a Muon parameter's state without a step (its update has no bias
# correction): missing on load, it reads as 0
TABLE["muon"] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)], "ignore": (), "fixed": {}, "states": {},
                 "step": "int", "step_optional": True, "bools": ("use_muon",)}
for _name in ("adamw8bit", "galore_adamw", "galore_adamw8bit", "q_galore", "apollo"):  # bitsandbytes / galore_torch: betas
    TABLE[_name] = {"group": [("beta1", "betas", 0), ("beta2", "betas", 1)], "ignore": (), "fixed": {},
                    "states": {}, "step": "int"}
_PLAIN = {"group": [], "ignore": (), "fixed": {}, "states": {}, "step": "int"}


def entry(name):
    return TABLE.get(name, _PLAIN)


def state_key(name, c_state):
    """The upstream state_dict key of distopt state `c_state` of optimizer `name`."""
    return entry(name)["states"].get(c_state, c_state)


def to_distopt(name, group, known=None):
    """distopt hyperparameters (key -> value) from a param_groups-style dict (without 'params').

    Returns (values, rest): `rest` holds the keys that are neither upstream nor distopt keys of the optimizer
    when `known` (the set of distopt keys) is given (e.g. a scheduler's 'initial_lr'); without `known`
    every such key goes into `values` (the library then rejects an unknown one)."""
    e = entry(name)
    tuples = {}
    for key, up, pos in e["group"]:
        if pos is not None:
            tuples.setdefault(up, []).append((pos, key))
    renamed = {up: key for key, up, pos in e["group"] if pos is None and up != key}
    values, rest, spelled = {}, {}, {}

    def put(key, v, given):  # one value per distopt key: betas=(...) with beta1=... is refused
        if key in spelled and spelled[key] != given:
            raise ValueError(f"distopt {name}: {spelled[key]} and {given} both set {key}; give one")
        spelled[key] = given
        values[key] = v

    for k, v in group.items():
        if k == "params":
            continue
        if k in tuples:
            want = max(p for p, _ in tuples[k]) + 1
            try:
                items = tuple(v)
            except TypeError:
                raise ValueError(f"distopt {name}: {k}={v!r} must be a tuple of {want} values") from None
            if len(items) != want:
                raise ValueError(f"distopt {name}: {k}={v!r} must be a tuple of {want} values")
            for pos, key in tuples[k]:
                put(key, items[pos], f"{k}={v!r}")
        elif k in renamed:
            put(renamed[k], v, f"{k}={v!r}")
        elif k in e["ignore"]:  # no effect on the computation: kept in param_groups as given
            rest[k] = v
        elif k in e["fixed"]:
            if v != e["fixed"][k]:
                raise ValueError(f"distopt {name}: {k}={v!r} is not supported (only {e['fixed'][k]!r})")
        elif known is None or k in known:
            put(k, v, f"{k}={v!r}")
        else:
            rest[k] = v
    return values, rest


def to_upstream(name, values):
    """A param_groups-style dict from distopt hyperparameters: upstream keys, tuples assembled."""
    e = entry(name)
    out, tuples = {}, {}
    mapped = {key: (up, pos) for key, up, pos in e["group"]}
    for key, v in values.items():
        if key in e.get("bools", ()) and v in ("true", "false"):
            v = v == "true"
        if key not in mapped:
            out[key] = v
            continue
        up, pos = mapped[key]
        if pos is None:
            out[up] = v
        else:
            tuples.setdefault(up, {})[pos] = v
            out.setdefault(up, None)  # keeps the upstream key order
    for k, v in e.get("defaults", {}).items():  # the upstream class's other group keys, at its defaults
        out.setdefault(k, v)
    for up, parts in tuples.items():
        if len(parts) == 1 + max(parts):
            out[up] = tuple(parts[i] for i in range(len(parts)))
        else:  # an incomplete tuple (should not happen): keep distopt's keys
            del out[up]
            for key, (u, pos) in mapped.items():
                if u == up and key in values:
                    out[key] = values[key]
    return out


# ---- recording upstream classes (distopt.record, docs/verify.md) ---------------------------------------
#
# How record() names an upstream optimizer class and reads its param_groups and states, so that a run of it
# records with no hand-written names. Looked up by (the class's top-level package, its class name). Fields:
#   name:      the distopt optimizer
#   group:     None, or a function(param_groups entry) -> the entry in the upstream spelling TABLE[name] reads
#              (galore's keys for a group without them, torch_optimizer's `debias`, an `inner`)
#   group_opt: the same with the optimizer as a second argument (Adam-mini: its name sets and head_numel)
#   attrs:     optimizer attributes (not group keys) that are distopt hyperparameters of every group:
#              {attribute: distopt key} (torch_optimizer.Lamb's debias and adam)
#   drop:      per-parameter state keys that are not optimizer state (diagnostics): never recorded
#   projector: galore_torch keeps a GaLoreProjector object under state["projector"]; its ortho_matrix (a list
#              [A, B] for proj_type="full") is recorded as the projector at every refresh (proj/<t>/...)
# Classes without an entry (and without name=) are recorded as they are, for distopt.replay.

def _galore_group(extra=None):
    """galore_torch's groups: a group without `rank` is not projected (distopt's rank=0)."""
    def adapt(group):
        g = dict(group)
        if "rank" not in g:
            for k in ("update_proj_gap", "scale", "proj_type"):
                g.pop(k, None)
            g["rank"] = 0
        g.update(extra or {})
        return g
    return adapt


def _galore_adafactor(group):
    """galore_torch.adafactor.Adafactor: HF Adafactor's keys (eps a pair) around galore_torch's projector."""
    g = _galore_group({"inner": "adafactor"})(group)
    if "eps" in g:
        g["eps1"], g["eps2"] = tuple(g.pop("eps"))
    return g


def _apollo_group(group, opt):
    """apollo_torch's APOLLOAdamW groups: a group without `rank` is not projected (distopt's rank=0); proj="random"
    is distopt's apollo (proj="svd" is GaLore's projector, refused); scale_front and disable_nl are the optimizer's
    attributes, every group's keys here."""
    g = {k: v for k, v in group.items() if k != "proj"}
    if "rank" not in g:
        for k in ("update_proj_gap", "scale", "proj_type", "scale_type"):
            g.pop(k, None)
        g["rank"] = 0
    elif group.get("proj", "random") != "random":
        raise ValueError(f"apollo_torch APOLLOAdamW proj={group.get('proj')!r}: distopt's apollo has the random "
                         f"projection only (proj='svd' is GaLore's projector: galore_adamw)")
    for attr in ("scale_front", "disable_nl"):
        g[attr] = bool(getattr(opt, attr, False))
    return g


def _soap_group(group, opt):
    """pytorch_optimizer.SOAP's groups as they are; its maximize attribute is refused (distopt's soap minimises;
    merge_dims=True is refused by distopt's validation)."""
    if getattr(opt, "maximize", False):
        raise ValueError("pytorch_optimizer.SOAP maximize=True: distopt's soap minimises (negate the loss)")
    return dict(group)


def _torch_muon(group):
    """torch.optim.Muon (torch >= 2.9) as distopt's muon with flavor=torch (its addmm-form Newton-Schulz, norm
    clamped at eps, docs/muon.md): every parameter a Muon matrix (use_muon true); ns_coefficients as ns_a, ns_b,
    ns_c; its eps (the Newton-Schulz normalisation's, not an Adam's) as ns_eps; adjust_lr_fn None as "none" (the
    flavour's own rule: torch's original)."""
    g = {k: v for k, v in group.items() if k not in ("eps", "ns_coefficients", "adjust_lr_fn")}
    coeffs = tuple(float(c) for c in group.get("ns_coefficients", (3.4445, -4.7750, 2.0315)))
    if len(coeffs) != 3:
        raise ValueError(f"torch.optim.Muon ns_coefficients={coeffs}: three values (a, b, c) expected")
    g["ns_a"], g["ns_b"], g["ns_c"] = coeffs
    g["ns_eps"] = float(group.get("eps", 1e-7))
    g["use_muon"] = True
    g["flavor"] = "torch"
    fn = group.get("adjust_lr_fn")
    g["adjust_lr_fn"] = "none" if fn is None else fn
    return g


# Adam-mini (adam-mini 1.1.1): upstream derives each parameter's block from its lower-cased name, in this order
ADAM_MINI_NAMES = {
    "adam_block_names": ("bias",),                                         # plain Adam per element
    "wqk_names": ("k_proj", "q_proj", "wq", "wk", "query", "key"),        # one v per head
    "embd_names": ("embed", "embd", "wte"),                                # one v per row (neuron), as the three below
    "output_names": ("lm_head", "output", "final_layer"),
    "wv_names": ("v_proj", "wv", "value"),
    "attn_proj_names": ("o_proj", "wo", "attn.proj"),
    "mlp_names": ("feed_forward", "linear", "mlp"),
}


def adam_mini_block(name, head_numel, sets=None):
    """(block, head_numel, decays) of a parameter named `name` under Adam-mini's rules (sets: upstream's name
    sets, e.g. an Adam_mini optimizer's own, which users extend; default ADAM_MINI_NAMES): block tensor for
    anything unnamed; decays False for names with norm, ln or bias (upstream sets their weight_decay to 0)."""
    n = str(name).lower()
    s = {k: tuple(getattr(sets, k, v)) if sets is not None else v for k, v in ADAM_MINI_NAMES.items()}
    decays = not ("norm" in n or "ln" in n or "bias" in n)
    if any(x in n for x in s["adam_block_names"]):
        return "elementwise", 0, decays
    if any(x in n for x in s["wqk_names"]):
        return "head", int(head_numel), decays
    if any(x in n for k in ("embd_names", "output_names", "wv_names", "mlp_names", "attn_proj_names")
           for x in s[k]):
        return "neuron", 0, decays
    return "tensor", 0, decays


def _adam_mini_group(group, opt):
    """An Adam_mini group (one parameter, its "name"): its block from the optimizer's own name sets and
    head_numel; beta1/beta2 are group keys upstream."""
    g = {k: v for k, v in group.items() if k != "name"}
    block, hn, _ = adam_mini_block(group.get("name", ""), getattr(opt, "head_numel", 0), opt)
    g["block"] = block
    if block == "head":
        g["head_numel"] = hn
    return g


def _normuon(group):
    """pytorch_optimizer.NorMuon's groups: ns_coeffs (a preset's list of (a, b, c)) as ns_a, ns_b, ns_c (one tuple
    only: a schedule of several is refused); a Muon group's beta2 is its rows' second moment, an AdamW group's
    betas[1] its second moment, distopt's beta2 both; use_muon as distopt's enum."""
    g = {k: v for k, v in group.items() if k != "ns_coeffs"}
    if "ns_coeffs" in group:
        cs = [tuple(float(x) for x in c) for c in group["ns_coeffs"]]
        if len(cs) != 1 or len(cs[0]) != 3:
            raise ValueError(f"pytorch_optimizer.NorMuon ns_coeffs={group['ns_coeffs']!r}: distopt's normuon takes "
                             f"one (a, b, c) for every iteration, not a schedule")
        g["ns_a"], g["ns_b"], g["ns_c"] = cs[0]
    g["use_muon"] = "true" if group.get("use_muon") else "false"
    return g


CLASSES = {
    ("torch", "AdamW"): {"name": "adamw"},
    ("torch", "Muon"): {"name": "muon", "group": _torch_muon},
    ("torch", "Adafactor"): {"name": "torch_adafactor"},
    ("schedulefree", "AdamWScheduleFree"): {"name": "adamw_schedulefree"},
    ("pytorch_optimizer", "NorMuon"): {"name": "normuon", "group": _normuon},
    ("pytorch_optimizer", "SOAP"): {"name": "soap", "group_opt": _soap_group,
                                    "drop": ("precondition_frequency", "shampoo_beta")},
    ("adam_mini", "Adam_mini"): {"name": "adam_mini", "group_opt": _adam_mini_group,
                                 "drop": ("head_per_gpu", "neuron_per_gpu", "block_numel", "reduced")},
    ("transformers", "Adafactor"): {"name": "adafactor"},
    ("came_pytorch", "CAME"): {"name": "came"},
    # torch_optimizer.Lamb: debias and adam are attributes; its clamp_value bounds ||p|| in the trust ratio,
    # distopt's lamb (ColossalAI's) has none: the two agree while ||p|| <= clamp_value (docs/verify.md)
    ("torch_optimizer", "Lamb"): {"name": "lamb", "attrs": {"debias": "bias_correction", "adam": "adam"},
                                  "drop": ("weight_norm", "adam_norm", "trust_ratio")},
    ("galore_torch", "AdamW"): {"name": "galore_adamw", "group": _galore_group(), "projector": True},
    # apollo-torch 1.0.3's APOLLOAdamW (apollo_torch.apollo.AdamW; the package's other AdamW classes are GaLore's):
    # its draws recorded at every refresh (state["projector"].ortho_matrix) and fed back by verify
    ("apollo_torch.apollo", "AdamW"): {"name": "apollo", "group_opt": _apollo_group, "projector": True,
                                       "drop": ("seed",)},
    ("galore_torch", "Adafactor"): {"name": "galore", "group": _galore_adafactor, "projector": True},
    ("galore_torch", "AdamW8bit"): {"name": "galore_adamw8bit", "group": _galore_group(), "projector": True},
    ("bitsandbytes", "AdamW8bit"): {"name": "adamw8bit"},
    ("bitsandbytes", "PagedAdamW8bit"): {"name": "adamw8bit"},
    # muon-optimizer 0.1.0: its groups (use_muon a bool, betas for the aux Adam) read through TABLE["muon"];
    # SingleDeviceMuon's groups have no use_muon (every parameter steps Muon)
    ("muon", "SingleDeviceMuonWithAuxAdam"): {"name": "muon"},
    ("muon", "SingleDeviceMuon"): {"name": "muon", "group": lambda g: dict(g, use_muon=True)},
}


# ColossalAI 0.5.0 (colossalai.nn.optimizer): the distributed optimizers its plugins cast the single-device ones to
# (cast_to_distributed), recorded by class; the shards they step (setup_distributed's TP d-tensors and ZeRO shards)
# are the user's layout=. "differs": where the class computes otherwise than the upstream distopt matches, read
# from its source: record() warns once, and verify names it at its step (the reference is never bent to it).
def _colossal_galore(group, opt):
    """DistGaloreAwamW / GaLoreAdamW8bit: galore_torch's group keys; bitsandbytes' settings from opt.args."""
    g = _galore_group()(group)
    args = getattr(opt, "args", None)
    for key in ("min_8bit_size", "percentile_clipping"):
        if args is not None and getattr(args, key, None) is not None:
            g[key] = getattr(args, key)
    return g


_COLOSSAL_ADAFACTOR = ("state RMS is never updated (its line is commented out): the relative step's parameter scale "
                       "is eps[1], not max(eps[1], RMS(p)) as transformers' Adafactor: verify names step 1")
CLASSES.update({
    ("colossalai", "Lamb"): {"name": "lamb", "attrs": {"adam": "adam"},
                             "drop": ("weight_norm", "adam_norm", "trust_ratio")},
    # no adam flag; bias_correction a group key (default True, the single-device Lamb's False)
    ("colossalai", "DistributedLamb"): {"name": "lamb", "group": lambda g: dict(g, adam=False)},
    ("colossalai", "Adafactor"): {"name": "adafactor", "differs": _COLOSSAL_ADAFACTOR},
    ("colossalai", "DistributedAdaFactor"): {
        "name": "adafactor",
        "differs": _COLOSSAL_ADAFACTOR + "; under ZeRO with the rows divisible by dp each shard is factored as its "
                                         "own block (column means over the local rows)"},
    ("colossalai", "CAME"): {"name": "came"},
    ("colossalai", "DistributedCAME"): {
        "name": "came",
        "differs": "from step 2 exp_avg_res_row/col are the squared-gradient statistics (an alias), and a "
                   "non-factored parameter's exp_avg is scaled by lr in place: verify names step 1 or 2"},
    ("colossalai", "GaLoreAdamW8bit"): {"name": "galore_adamw8bit", "group_opt": _colossal_galore, "projector": True},
    ("colossalai", "DistGaloreAwamW"): {"name": "galore_adamw8bit", "group_opt": _colossal_galore, "projector": True},
})


def upstream_class(cls):
    """The CLASSES entry of an optimizer class (its module and name, else its top-level package and name, for a
    package with several classes of one name; a subclass is not matched: it may compute something else), or
    None."""
    return CLASSES.get((cls.__module__, cls.__name__)) or CLASSES.get((cls.__module__.split(".")[0], cls.__name__))
