"""The compiled hot modules (kvcc/accel.py): loaded only while their source is unchanged, off with
``KVCC_ACCEL=0``, current after setup, and the source they were compiled from giving the same
verdicts as they do."""

import json
import os
import subprocess
import sys
import textwrap

from kvcc import accel

PROBE = textwrap.dedent(
    """
    import cython


    def compiled():
        return bool(cython.compiled)
    """
)


def _run(code, env, cwd):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_compiled_module_is_loaded_only_while_its_source_is_unchanged(tmp_path):
    pkg = tmp_path / "src" / "accelprobe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "src"), KVCC_ACCEL_DIR=str(tmp_path / "accel"))
    env.pop("KVCC_ACCEL", None)
    probe = """
        import json, kvcc
        from kvcc import accel
        import accelprobe.mod as m
        finder = accel._finder
        print(json.dumps({"compiled": m.compiled(), "file": m.__file__,
                          "stale": sorted(finder.stale) if finder else None}))
    """
    # Nothing built: the source.
    assert _run(probe, env, tmp_path)["compiled"] is False
    built = _run("""
        import json
        from kvcc import accel
        print(json.dumps(accel.build(("accelprobe.mod",))))
    """, env, tmp_path)  # fmt: skip
    assert built == ["accelprobe.mod"]
    got = _run(probe, env, tmp_path)
    assert got["compiled"] is True and got["file"].startswith(str(tmp_path / "accel"))
    # Built again: nothing changed, nothing compiled.
    assert _run("import json; from kvcc import accel; print(json.dumps(accel.build(('accelprobe.mod',))))", env, tmp_path) == []
    # Off by the environment.
    assert _run(probe, dict(env, KVCC_ACCEL="0"), tmp_path)["compiled"] is False
    # The source edited after the build: the source runs, and the finder says why.
    (pkg / "mod.py").write_text(PROBE + "\n# edited\n")
    got = _run(probe, env, tmp_path)
    assert got["compiled"] is False and got["file"].endswith("mod.py") and got["stale"] == ["accelprobe.mod"]
    # A manifest written by another interpreter is not read.
    (pkg / "mod.py").write_text(PROBE)
    assert _run(probe, env, tmp_path)["compiled"] is True
    manifest = tmp_path / "accel" / accel.MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(dict(data, abi="cpython-99-other.so")))
    assert _run(probe, env, tmp_path)["compiled"] is False


def test_the_hot_modules_run_compiled_after_setup():
    """scripts/setup.sh (which scripts/test.sh runs) compiles them: every one current and loaded
    here, or the benchmark's figures would be the source's."""
    got = accel.status()
    assert got["enabled"], "KVCC_ACCEL=0 is set"
    stale = [name for name, s in got["modules"].items() if not (s["current"] and s["loaded"])]
    assert not stale, f"not compiled or not current: {stale}; run `kvcc accel build` (scripts/setup.sh does)"


def test_the_source_modules_give_the_corpus_verdicts_too():
    """Every test but this one runs the compiled modules: the source they were compiled from,
    run as Python (``KVCC_ACCEL=0``), gives every corpus trace its recorded verdict as well."""
    corpus = os.path.join(os.path.dirname(__file__), "corpus", "validate")
    env = dict(os.environ, KVCC_ACCEL="0")
    got = _run(f"""
        import json, os
        from kvcc import accel
        from kvcc.conformance import validate
        corpus = {corpus!r}
        out = {{"compiled": accel.compiled_modules(), "wrong": []}}
        for case in json.load(open(os.path.join(corpus, "manifest.json")))["cases"]:
            with open(os.path.join(corpus, case["file"])) as f:
                events = [json.loads(line) for line in f if line.strip()]
            v = validate.validate_trace(events, validate.TraceParams(case["lease_term_ms"], case["skew_ms"]))
            verdict = {{"status": v.status, "code": v.code, "event_index": v.event_index}}
            if verdict != case["expected"]:
                out["wrong"].append([case["file"], verdict])
        print(json.dumps(out))
    """, env, corpus)  # fmt: skip
    assert got == {"compiled": [], "wrong": []}
