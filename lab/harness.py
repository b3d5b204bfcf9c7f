"""
lab/eval.py's adapter to lm-evaluation-harness (`python -m lab.eval --lm_eval TASKS`): our model in one
mode as a harness LM, so that its task zoo runs as is (log-likelihood, rolling, generation).
"""
if not __package__:   # run by its path: the project's modules are importable from its root only
    import sys
    print("error: a lab script runs from the project root as a module: python -m "
          "lab.harness ...", file=sys.stderr)
    raise SystemExit(2)   # a mistake of the user's: exit 2, as everywhere
from configurator import UserError, split_list
from engine.request import Request
from modes import continuation_logprobs


def lm_eval_adapter(model, encode, decode, mode, thr, depth, c, device, make_engine):
    """Our model in one mode as an lm-evaluation-harness LM, so that its task zoo runs as is;
    make_engine(model, c, mode) builds the engine of its generations (lab/eval.py's)."""
    from lm_eval.api.model import LM
    prefix = encode("\n")[:1] or [0]

    class LoopedLM(LM):
        def loglikelihood(self, requests):
            pairs = [(encode(ctx) or prefix, encode(cont))
                     for ctx, cont in (r.args for r in requests)]
            return [(lp, greedy) for lp, greedy, _ in continuation_logprobs(model, pairs, mode,
                                                                            thr, depth,
                                                                             c["batch_size"], device)]

        def loglikelihood_rolling(self, requests):
            out = []
            for r in requests:
                ids = encode(r.args[0])
                T = model.config.block_size
                total, start = 0.0, 0
                while start < len(ids):      # every token predicted once, each window with the most context
                    end = min(start + T, len(ids))
                    ctx = (prefix + ids)[max(0, end - T):start + 1] if start == 0 else ids[max(0, end - T - 1):start]
                    total += continuation_logprobs(model, [(ctx, ids[start:end])], mode, thr, depth, 1, device)[0][0]
                    start = end
                out.append(total)
            return out

        def generate_until(self, requests):
            items = []
            for r in requests:
                ctx, kw = r.args
                items.append((encode(ctx), kw.get("until") or [], int(kw.get("max_gen_toks", c["max_tokens"]))))
            engine = make_engine(model, c, mode)
            reqs = []
            for ids, until, cap in items:
                ids = ids[-(model.config.block_size - 1):]
                rq = Request(ids, max(1, min(cap, model.config.block_size - len(ids))), mode,
                             thr=0.5 if thr is None else thr, depth=depth or 0, temperature=0.0)
                rq.until = [u for u in until if isinstance(u, str)]

                def on_token(rq, tok):
                    if tok is not None and any(u in decode(rq.tokens) for u in rq.until):
                        rq.cancelled = True
                rq.on_token = on_token
                reqs.append(engine.add(rq))
            while engine.busy():
                engine.step()
            texts = []
            for rq in reqs:
                text = decode(rq.tokens)
                cut = [text.index(u) for u in rq.until if u in text]
                texts.append(text[:min(cut)] if cut else text)
            return texts

    return LoopedLM()


def check_tasks(c):
    """Before any work: lm-eval is installed and knows every task of --lm_eval."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("--lm_eval needs the optional lm-eval package (pip install lm-eval) and "
                        "its tasks' datasets")
    known = set(TaskManager(include_path=c["lm_eval_include"] or None).all_tasks)
    unknown = [t for t in split_list("lm_eval", c["lm_eval"]) if t not in known]
    if unknown:
        raise UserError(f"--lm_eval={c['lm_eval']}: unknown task {unknown[0]!r} (lm-eval knows "
                        f"{len(known)} tasks; --lm_eval_include adds task YAMLs of your own)")


def run(model, encode, decode, specs, c, device, make_engine):
    """Each --modes spec through lm-evaluation-harness (check_tasks has checked it first)."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=c["lm_eval_include"] or None)
    runs = []
    for spec in specs:
        try:
            res = lm_eval.simple_evaluate(model=lm_eval_adapter(model, encode, decode, *spec,
                                                                c, device, make_engine),
                                          tasks=split_list("lm_eval", c["lm_eval"]),
                                          num_fewshot=c["shots"] or None, limit=c["limit"] or None,
                                          task_manager=manager)
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as e:
            # its task's data could not be loaded (offline, a missing local file), ...
            raise UserError(f"--lm_eval={c['lm_eval']}: lm-evaluation-harness failed to run it: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} "
                            "(offline? its datasets must be on disk)")
        for task, metrics in res["results"].items():
            runs.append(dict(task=f"lm_eval:{task}", mode=spec[0], thr=spec[1], depth=spec[2],
                             n_items=None,
                             acc=metrics.get("acc,none"), acc_norm=metrics.get("acc_norm,none"),
                             pass_at=None, stderr=metrics.get("acc_stderr,none"), avg_depth=None,
                             lm_eval=metrics))
    return runs


if __name__ == "__main__":
    from configurator import library
    library(__doc__, "python -m lab.eval --lm_eval=TASKS runs it")
