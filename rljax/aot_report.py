"""What `rljax.aot.check` found, for people: the per-device byte table, the fit of each
compiled program in its chip's HBM, and a roofline prediction of step time, MFU and
decode tokens/s.

The roofline is a prediction, not a measurement (no TPU has run these programs). Its FLOPs
and bytes per chip are the compiled programs' own, counted from their optimized HLO with
every loop body times its trip count (`rljax.hlo_flops`: the compiler's `cost_analysis`
counts a while body once, so the layer scan is one layer, the engine's decode loop one
step): step time = max(FLOPs / chip peak, bytes / HBM bandwidth), MFU = model FLOPs /
(chips x peak x step time); a decode call's counts are divided by its steps (its loop
counted at steps_per_call, an upper bound: it stops when every slot is done; its switch
over context buckets at the largest, a full max_seq_len, where the analytic count takes
a mean context of half that). The analytic counts from the model's shape (below) stand
beside them (`analytic_*`) with their ratio (`compiler_over_analytic_*`: remat's
recompute, attention over whole key blocks, the MoE's padding and masked expert work,
the compiler's copies), and are the prediction where a program was not compiled.
Collectives are not modelled: the predicted time is a lower bound on a step's, the MFU an
upper bound.

Analytic counts (global, per train step; T tokens in rows of R, L layers, H heads of d,
V vocab, N the active parameters in layer and head matmuls):
* model FLOPs (MFU's numerator): 6 N T + 6 L H d R T (causal attention: half the scores);
* hardware FLOPs: the layers' matmuls again when rematerialised (8 N T instead of 6), and
  attention over every key block of the row (12 L H d R T; 16 with remat);
* HBM bytes per chip, at least: the train state read and written once (f32 master and two
  moments), the bf16 weights a chip computes with read once per pass (forward, backward,
  and the rematerialised forward), and the step's batch.
Decode, per engine step of S slots at a mean context C: FLOPs 2 N S + 4 L H d C S; bytes
per chip the bf16 weights it holds (every expert is touched when S x k >= experts) and the
KV of the slots it serves, read once.
"""

from __future__ import annotations

from rljax.aot import GIB, PROGRAMS

# HBM per chip, in bytes (vendors' GB), for the plan without a compile
BUDGETS = {"H200": 141e9, "TPU v5p": 95e9, "H100": 80e9}
# TPU chips: HBM bytes, peak bf16 FLOP/s, HBM bytes/s (Google Cloud's published figures)
CHIPS = {"v5p": (95e9, 459e12, 2.765e12), "v5e": (16e9, 197e12, 0.819e12),
         "v6e": (32e9, 918e12, 1.640e12)}
FIT = 0.8  # the share of a chip's HBM a program may plan to use (the rest: runtime, fragments)


def chip(topology: str) -> tuple[str, float, float, float]:
  """(generation, HBM bytes, bf16 FLOP/s, HBM bytes/s) of a topology like "v5p:4x4x4"."""
  generation = topology.split(":")[0]
  if generation not in CHIPS:
    raise ValueError(f"no chip figures for {generation!r}; known: {sorted(CHIPS)}")
  return (generation, *CHIPS[generation])


def fits(report: dict) -> dict[str, dict]:
  """Each compiled program's peak bytes per chip (arguments + unaliased outputs + temps)
  against FIT of its chip's HBM (the engine's on the rollout host's slice)."""
  out = {}
  for name in PROGRAMS:
    memory = report[name].get("memory")
    if memory:
      engine = name in ("decode", "prefill")
      _, hbm, _, _ = chip(report["decode_topology" if engine else "topology"])
      share = memory["peak"] / hbm
      out[name] = {"peak_gib": round(memory["peak"] / GIB, 2), "hbm_share": round(share, 3),
                   "fits": share <= FIT}
  return out


def _layer_matmul_params(m: dict) -> tuple[float, float]:
  """(active matmul params per layer, LM head params) of the report's model."""
  d, hd = m["hidden_size"], m["head_dim"]
  attention = d * hd * (2 * m["num_attention_heads"] + 2 * m["num_key_value_heads"])
  experts = 3 * d * m["moe_intermediate_size"] * m["num_experts_per_tok"]
  router = d * m["num_experts"]
  return attention + experts + router, d * m["vocab_size"]


def _bound(flops: float, nbytes: float, peak: float, bandwidth: float) -> dict:
  """A step's time on one chip from its FLOPs and HBM bytes (whichever takes longer)."""
  compute_s, memory_s = flops / peak, nbytes / bandwidth
  return {"compute_s": compute_s, "memory_s": memory_s, "step_s": max(compute_s, memory_s),
          "bound": "compute" if compute_s >= memory_s else "memory"}


def roofline(report: dict) -> dict:
  """Predicted train step time and MFU, and a rollout host's decode tokens/s, on the
  report's topology: from the compiled programs' trip-counted HLO counts where compiled,
  with the analytic counts beside them (see the module docstring)."""
  generation, _, peak, bandwidth = chip(report["topology"])
  m, train = report["model"], report["train"]
  layers, heads, hd = m["num_hidden_layers"], m["num_attention_heads"], m["head_dim"]
  per_layer, head = _layer_matmul_params(m)
  n = layers * per_layer + head
  out: dict = {"chip": generation, "peak_flops": peak, "hbm_bytes_per_s": bandwidth}

  chips = report["chips"]
  row = train["row_len"]
  tokens = train["microbatch_tokens"] * train["microbatches"]
  attention = layers * heads * hd * row * tokens
  model_flops = 6 * n * tokens + 6 * attention
  passes = 3 if m["remat"] else 2  # forward, backward (2x a forward), rematerialised forward
  hardware_flops = ((2 * passes + 2) * layers * per_layer + 6 * head) * tokens + (
      4 * (passes + 1) * attention)
  d = report["per_device_bytes"]
  # what a chip computes with: its bf16 shards gathered over fsdp (experts stay put)
  weights_used = d["params_bf16_train"] * report["mesh"].get("fsdp", 1)
  train_bytes = 2 * d["train_state"] + passes * weights_used + d["train_batch"]
  analytic = _bound(hardware_flops / chips, train_bytes, peak, bandwidth)
  t = {"tokens": tokens, "model_flops": model_flops,
       "analytic_flops_per_chip": hardware_flops / chips,
       "analytic_bytes_per_chip": train_bytes, "analytic_step_s": analytic["step_s"],
       "analytic_mfu": model_flops / (chips * peak * analytic["step_s"])}
  t.update(_from_compiler(train, t["analytic_flops_per_chip"], train_bytes, 1, peak,
                          bandwidth) or dict(analytic, source="analytic"))
  t["mfu"] = model_flops / (chips * peak * t["step_s"])
  out["train"] = t

  _, _, peak, bandwidth = chip(report["decode_topology"])
  decode = report["decode"]
  slots, context = decode["num_slots"], decode["max_seq_len"] / 2  # mean context: half full
  host_chips = 1
  for size in report["decode_mesh"].values():
    host_chips *= size
  step_flops = 2 * n * slots + 4 * layers * heads * hd * context * slots
  kv_bytes = slots * context * report["kv"]["bytes_per_token"] / host_chips
  step_bytes = d["params_bf16_serving"] + kv_bytes
  analytic = _bound(step_flops / host_chips, step_bytes, peak, bandwidth)
  dec = {"slots": slots, "mean_context": context, "chips": host_chips,
         "analytic_flops_per_step": step_flops,
         "analytic_flops_per_chip_per_step": step_flops / host_chips,
         "analytic_bytes_per_chip_per_step": step_bytes, "analytic_step_s": analytic["step_s"],
         "analytic_tokens_per_s": slots / analytic["step_s"],
         "peak_flops": peak, "hbm_bytes_per_s": bandwidth}
  # one engine call runs steps_per_call decode steps
  dec.update(_from_compiler(decode, step_flops / host_chips, step_bytes,
                            decode.get("steps_per_call", 1), peak, bandwidth)
             or dict(analytic, source="analytic"))
  dec["tokens_per_s"] = slots / dec["step_s"]
  out["decode"] = dec
  return out


def _from_compiler(program: dict, analytic_flops: float, analytic_bytes: float, steps: int,
                   peak: float, bandwidth: float) -> dict | None:
  """The roofline of a compiled program's trip-counted HLO FLOPs and bytes per chip (a
  call of `steps` steps: per step), with their ratios to the analytic counts; None when it
  was not compiled (the prediction is then the analytic one)."""
  hlo = program.get("hlo")
  if not hlo:
    return None
  flops, nbytes = hlo["matmul_flops_per_chip"] / steps, hlo["bytes_per_chip"] / steps
  return {"source": "compiler", "compiler_flops_per_chip": flops,
          "compiler_bytes_per_chip": nbytes,
          "compiler_over_analytic_flops": flops / analytic_flops,
          "compiler_over_analytic_bytes": nbytes / analytic_bytes,
          "compiler_loops_unknown": len(hlo["unknown_loops"]),
          "compiler_loops_at_upper_bound": len(hlo["bounded_loops"]),
          "compiler_conditionals": hlo["conditionals"],
          "xla_cost_analysis_flops_per_chip_loops_once": (program.get("cost") or {}).get(
              "flops"), **_bound(flops, nbytes, peak, bandwidth)}


def table(report: dict) -> str:
  g, d = report["global_bytes"], report["per_device_bytes"]
  mesh = lambda m: " ".join(f"{k}={v}" for k, v in m.items())  # noqa: E731
  lines = [f"params {report['params_total'] / 1e9:.2f}B total, "
           f"{report['params_active'] / 1e9:.2f}B active; platform {report['platform']}",
           f"train mesh  [{mesh(report['mesh'])}]",
           f"decode mesh [{mesh(report['decode_mesh'])}] rules={report['decode_rules']}",
           "", f"{'':<38}{'global GiB':>12}{'per device GiB':>16}{'per device bytes':>18}"]
  rows = (("trainer: params f32 master", "params_f32"),
          ("trainer: params bf16 (serving bits)", "params_bf16_train"),
          ("trainer: adam mu", "adam_mu"), ("trainer: adam nu", "adam_nu"),
          ("trainer: step counts", "counts"),
          ("trainer: state (master + opt)", "train_state"),
          ("trainer, LoRA: adapters f32", "lora_adapters_f32"),
          ("trainer, LoRA: adam mu + nu", "lora_adam"),
          ("trainer, LoRA: base bf16 + state", "lora_train_state"),
          ("trainer: one step's batch", "train_batch"),
          ("trainer: kl_to_start reference bf16", "kl_reference_bf16"),
          ("engine: params bf16", "params_bf16_serving"),
          ("engine: KV pages (k + v)", "kv_pages"),
          ("engine: params + KV", "engine"))
  for label, key in rows:
    lines.append(f"{label:<38}{g[key] / GIB:>12.3f}{d[key] / GIB:>16.3f}{d[key]:>18,}")
  kv = report["kv"]
  lines.append(f"KV: {kv['shape']} spec {kv['spec']}, {kv['bytes_per_token']:,} B/token")
  for name in PROGRAMS:
    r = report[name]
    if r.get("skipped"):
      continue
    status = (f"lowered in {r['lower_s']} s" if r["lowered"] else f"LOWERING FAILED: "
              f"{r.get('error')}")
    if r["compiled"]:
      status += f", compiled in {r['compile_s']} s"
    elif r["lowered"]:
      status += f"; not compiled: {r.get('compile_skipped') or r.get('compile_error')}"
    lines.append(f"{name} step: {status}")
    if r.get("memory"):
      lines.append("  memory_analysis per device (GiB): " + ", ".join(
          f"{k} {v / GIB:.3f}" for k, v in r["memory"].items()))
  lines.append("per-device budget (weights + KV or state + batch; compiled temporaries "
               "come on top):")
  for name, budget in BUDGETS.items():
    shares = [f"{who} {need / budget:.0%}" for who, need in
            (("engine", d["engine"]),
             ("trainer", d["train_state"] + d["train_batch"] + d["kl_reference_bf16"]),
             (f"LoRA r{report['lora']['rank']} trainer",
              d["lora_train_state"] + d["train_batch"]))]
    lines.append(f"  {name} ({budget / 1e9:.0f} GB): " + ", ".join(shares))
  if report.get("topology"):
    lines += topology_lines(report)
  return "\n".join(lines)


def topology_lines(report: dict) -> list[str]:
  """The TPU compiler's fit and the roofline prediction (`fits`, `roofline`)."""
  generation, hbm, _, _ = chip(report["topology"])
  lines = [f"TPU compiler, {report['topology']} ({generation}, {hbm / 1e9:.0f} GB HBM a chip; "
           f"a program fits at <= {FIT:.0%}):"]
  for name, f in fits(report).items():
    lines.append(f"  {name}: peak {f['peak_gib']} GiB a chip = {f['hbm_share']:.0%} of HBM"
                 f" ({'fits' if f['fits'] else 'DOES NOT FIT'})")
  r = roofline(report)
  t, dec, peak, bandwidth = r["train"], r["decode"], r["peak_flops"], r["hbm_bytes_per_s"]

  def counted(x: dict) -> str:
    return (f"HLO, {x['compiler_over_analytic_flops']:.2f}x the analytic FLOPs"
            if x["source"] == "compiler" else "analytic")
  lines += [
      "roofline (a prediction: no collectives; see rljax/aot_report.py):",
      f"  train step: {t['tokens']:,} tokens, {t['compute_s'] * peak / 1e12:.1f} TFLOP and "
      f"{t['memory_s'] * bandwidth / 1e9:.1f} GB a chip ({counted(t)}) -> {t['step_s']:.3f} s "
      f"({t['bound']}-bound), MFU <= {t['mfu']:.0%} (analytic: {t['analytic_step_s']:.3f} s,"
      f" {t['analytic_mfu']:.0%})",
      f"  decode: {dec['slots']} slots at context {dec['mean_context']:.0f} on {dec['chips']} "
      f"chips: {dec['step_s'] * 1e3:.2f} ms a step ({counted(dec)}, "
      f"{dec['bound']}-bound), {dec['tokens_per_s']:,.0f} tokens/s (analytic: "
      f"{dec['analytic_tokens_per_s']:,.0f})"]
  return lines
