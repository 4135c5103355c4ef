#!/usr/bin/env python
"""Run DeepSpeed's own tests/unit files against real DeepSpeed and/or hf_zero, one file at a time.

usage: run.py --engine ds|hz --file unit/runtime/test_x.py [--max-per-func N] [--only-ids IDSFILE] [--tag T]
Writes $DSUNIT_ROOT/results/<engine>/<tag>.json (id -> outcome, message) and $DSUNIT_ROOT/logs/<engine>/<tag>.log
Environment (defaults in brackets): DSUNIT_ROOT [/work/dsunit], DS_PYTHON [/work/dsvenv/bin/python],
HZ_PYTHON [/work/venv/bin/python], DS_SITE [DeepSpeed's site-packages, for hzcompat], HZ_COMPAT [1], HZ_COMPAT_LOG.
"""
import argparse, json, os, re, subprocess, sys, time, xml.etree.ElementTree as ET
from collections import OrderedDict

ROOT = os.environ.get("DSUNIT_ROOT", "/work/dsunit")
TESTS = os.path.join(ROOT, "tests")
HERE = os.path.dirname(os.path.abspath(__file__))  # hzcompat/ lives next to this file
PY = {"ds": os.environ.get("DS_PYTHON", "/work/dsvenv/bin/python"),
      "hz": os.environ.get("HZ_PYTHON", "/work/venv/bin/python")}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def env_for(engine):
    env = dict(os.environ)
    env["DS_UNITTEST_TIMEOUT"] = env.get("DS_UNITTEST_TIMEOUT", "120")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["LOCAL_SIZE"] = "2"  # CPU accelerator device count in the pytest process (DeepSpeed launcher semantics)
    if engine == "ds":
        env["HF_ZERO_DISABLE_DEEPSPEED_SHIM"] = "1"
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env.pop("HF_ZERO_DISABLE_DEEPSPEED_SHIM", None)
        env.pop("DS_ACCELERATOR", None)
        # hjson (a DeepSpeed dependency some test files import) and, if asked, the compat stubs
        extra = [os.path.join(ROOT, "extra_site")]
        if env.get("HZ_COMPAT", "1") == "1":
            extra.insert(0, os.path.join(HERE, "hzcompat"))
            env.setdefault("DSUNIT_ROOT", ROOT)
        env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def collect(engine, f):
    out = subprocess.run([PY[engine], "-m", "pytest", f, "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=TESTS, env=env_for(engine), capture_output=True, text=True)
    ids, cls = [], None
    cls_indent = -1
    for l in ANSI.sub("", out.stdout).splitlines():
        m = re.match(r"^(\s*)<(\w+) (.+)>$", l)
        if not m:
            continue
        ind, kind, name = len(m.group(1)), m.group(2), m.group(3)
        if kind == "Class":
            cls, cls_indent = name, ind
        elif kind == "Function":
            if cls is not None and ind > cls_indent:
                ids.append(f"{f}::{cls}::{name}")
            else:
                cls = None
                ids.append(f"{f}::{name}")
        elif kind == "Module":
            cls = None
    return ids, ANSI.sub("", out.stdout + out.stderr)


def thin(ids, k):
    if not k:
        return ids
    groups = OrderedDict()
    for i in ids:
        groups.setdefault(i.split("[")[0], []).append(i)
    res = []
    for g in groups.values():
        if len(g) <= k:
            res += g
        else:
            step = (len(g) - 1) / (k - 1) if k > 1 else 0
            res += [g[round(j * step)] for j in range(k)]
    return res


def parse_junit(path):
    res = {}
    if not os.path.exists(path):
        return res
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls, name = tc.get("classname") or "", tc.get("name") or ""
        if not name:  # a truncated entry written when pytest.exit() interrupts a test
            continue
        mod = cls.split(".")
        # classname like unit.runtime.test_x.TestY
        parts = [p for p in mod]
        fpath, rest = [], []
        for i, p in enumerate(parts):
            if p.startswith("test_"):
                fpath = parts[:i + 1]; rest = parts[i + 1:]; break
        tid = "/".join(fpath) + ".py::" + "::".join(rest + [name])
        outcome, msg = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, msg = ("failed" if child.tag == "failure" else "error"), (child.get("message") or "")[:600]
                msg += "\n" + (child.text or "")[-3000:]
            elif child.tag == "skipped":
                outcome, msg = "skipped", (child.get("message") or "")[:300]
        res[tid] = {"outcome": outcome, "msg": msg, "time": float(tc.get("time", 0))}
    return res


def run(engine, f, ids, tag, per_test_timeout):
    os.makedirs(os.path.join(ROOT, "results", engine), exist_ok=True)
    os.makedirs(os.path.join(ROOT, "logs", engine), exist_ok=True)
    log = open(os.path.join(ROOT, "logs", engine, tag + ".log"), "a")
    results, remaining, attempt = {}, list(ids), 0
    while remaining and attempt < 20:
        attempt += 1
        xml = os.path.join(ROOT, "logs", engine, f"{tag}.{attempt}.xml")
        cmd = [PY[engine], "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--tb=short",
               f"--timeout={per_test_timeout}", "--junitxml", xml] + remaining
        log.write(f"\n##### attempt {attempt}: {' '.join(cmd[:8])} ... ({len(remaining)} ids)\n"); log.flush()
        start = log.tell()
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=TESTS, env=env_for(engine), stdout=log, stderr=subprocess.STDOUT,
                               timeout=per_test_timeout * len(remaining) + 120)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "outer-timeout"
        log.write(f"\n##### rc={rc} in {time.time()-t0:.0f}s\n"); log.flush()
        got = parse_junit(xml)
        results.update(got)
        done = set(results)
        rest = [i for i in remaining if i not in done]
        if not rest:
            break
        if got and not any(i in got for i in remaining):
            # nothing ran: a collection error (its junit entry names the module, not a test)
            err = next((r["msg"] for r in got.values() if r["outcome"] == "error"), f"rc={rc}")
            for i in rest:
                results[i] = {"outcome": "collect-error", "msg": err, "time": 0}
            break
        with open(log.name) as fh:
            fh.seek(start)
            exited = "_pytest.outcomes.Exit" in fh.read()  # DeepSpeed's DistributedTest hang guard (rc 1)
        if rc in (0, 1) and got and not exited:
            # ids that pytest could not resolve
            for i in rest:
                results[i] = {"outcome": "not-run", "msg": f"rc={rc}", "time": 0}
            break
        # the first missing id hung (pytest.exit / timeout): record it and go on with the rest
        results[rest[0]] = {"outcome": "hang", "msg": f"rc={rc} (pytest exited / timed out)", "time": 0}
        remaining = rest[1:]
    out = os.path.join(ROOT, "results", engine, tag + ".json")
    old = json.load(open(out)) if os.path.exists(out) else {}
    old.update(results)
    json.dump(old, open(out, "w"), indent=1)
    c = {}
    for r in results.values():
        c[r["outcome"]] = c.get(r["outcome"], 0) + 1
    print(engine, tag, c, flush=True)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["ds", "hz"], required=True)
    ap.add_argument("--file", required=True)
    ap.add_argument("--max-per-func", type=int, default=0)
    ap.add_argument("-k", default=None, help="regex on ids to keep")
    ap.add_argument("--only-ids", default=None, help="json results file of the other engine: run its passed ids")
    ap.add_argument("--timeout", type=int, default=150)
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    tag = a.tag or a.file.replace("unit/", "").replace("/", "__").replace(".py", "")
    if a.only_ids:
        prev = json.load(open(a.only_ids))
        ids = [i for i, r in prev.items() if r["outcome"] == "passed" and i.startswith(a.file + "::")]
    else:
        ids, txt = collect(a.engine, a.file)
        if not ids:
            print(txt[-3000:])
            os.makedirs(os.path.join(ROOT, "results", a.engine), exist_ok=True)
            json.dump({a.file: {"outcome": "collect-error", "msg": txt[-3000:], "time": 0}},
                      open(os.path.join(ROOT, "results", a.engine, tag + ".json"), "w"), indent=1)
            return
        if a.k:
            ids = [i for i in ids if re.search(a.k, i)]
        ids = thin(ids, a.max_per_func)
    if not ids:
        print("no ids"); return
    run(a.engine, a.file, ids, tag, a.timeout)


if __name__ == "__main__":
    main()
