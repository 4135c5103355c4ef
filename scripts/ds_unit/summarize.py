"""Summarise $DSUNIT_ROOT/results/{ds,hz}/*.json into results/summary.{json,txt-on-stdout}: per-file counts and,
for every id DeepSpeed passed and hf_zero did not, the exception lines and the last hf_zero frame."""
import json, glob, os, re
R = os.path.join(os.environ.get("DSUNIT_ROOT", "/work/dsunit"), "results")
rows, diffs = [], []
for f in sorted(glob.glob(f"{R}/ds/*.json")):
    tag = os.path.basename(f)[:-5]
    ds = json.load(open(f))
    hzf = f"{R}/hz/{tag}.json"
    hz = json.load(open(hzf)) if os.path.exists(hzf) else {}
    c = lambda d, o: sum(1 for v in d.values() if v["outcome"] == o)
    dsp = [i for i, v in ds.items() if v["outcome"] == "passed"]
    row = {"file": tag, "ds_passed": c(ds, "passed"), "ds_failed": c(ds, "failed") + c(ds, "error") + c(ds, "hang"),
           "ds_skipped": c(ds, "skipped"), "hz_run": len(hz), "hz_passed": c(hz, "passed"),
           "hz_failed": sum(1 for v in hz.values() if v["outcome"] in ("failed", "error", "hang", "not-run", "collect-error")),
           "hz_skipped": c(hz, "skipped")}
    rows.append(row)
    for i in dsp:
        v = hz.get(i)
        if v and v["outcome"] != "passed":
            msg = v["msg"]
            hzlines = re.findall(r'File "[^"]*/(hf_zero/[^"]+)", line (\d+)', msg)
            where = f"{hzlines[-1][0]}:{hzlines[-1][1]}" if hzlines else ""
            exc = [l for l in msg.splitlines() if re.match(r"^\s*(E\s+)?[\w.]*(Error|Exception|Missing|Timeout|assert)", l)]
            diffs.append({"id": i, "hz_outcome": v["outcome"], "first_line": msg.splitlines()[0][:300] if msg else "",
                          "exc": exc[-3:], "hf_zero_frame": where})
json.dump({"files": rows, "ds_pass_hz_fail": diffs}, open(f"{R}/summary.json", "w"), indent=1)
print(f"{'file':55s} DS p/f/s   HZ p/f/s (of DS-passing)")
for r in rows:
    print(f"{r['file']:55s} {r['ds_passed']}/{r['ds_failed']}/{r['ds_skipped']}   {r['hz_passed']}/{r['hz_failed']}/{r['hz_skipped']} (ran {r['hz_run']})")
for d in diffs:
    print("\n", d["id"], d["hz_outcome"], d["hf_zero_frame"]); print("   ", d["first_line"][:250]); [print("    |", e[:250]) for e in d["exc"]]
