"""The sizing page's Python (labs/labkit/predict/sizing.py), without a browser: the ZeRO paper's
example, the planner's answer as labs/plan.py gives it, and bad input as one line."""

import json
from pathlib import Path

import pytest

import plan
from labkit.predict import sizing


def test_the_zero_papers_example():
    """Rajbhandari et al. (2020), section 5: 7.5B parameters on 64 GPUs, Adam in mixed
    precision: 120, 31.4, 16.6 and 1.9 GB of model states per GPU."""
    result = sizing.run({"model": "params", "params": "7.5B", "gpus": "64"})
    got = {stage: round(m["total"] / 1e9, 1) for stage, m in result["memory_per_gpu"].items()}
    assert got == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


@pytest.mark.parametrize("matmuls, tp_overlap", [("bf16", "none"), ("fp8_activations", "gemm")])
def test_the_planner_answers_as_the_command_line_does(capsys, matmuls, tp_overlap):
    fields = {"model": "llama3-70b", "gpus": "256", "global_batch_tokens": "4M",
              "layout": "tp=8,pp=1,dp=32", "matmuls": matmuls, "tp_overlap": tp_overlap}
    result = sizing.run(fields)
    assert ("--precision fp8 --fp8-activations" in result["command"]) == (matmuls != "bf16")
    assert ("--tp-comm-overlap" in result["command"]) == (tp_overlap == "gemm")
    plan.main(result["command"].split()[2:] + ["--json"])
    cli = json.loads(capsys.readouterr().out)
    keys = ("dp", "tp", "pp", "cp", "ep", "etp", "chunks", "zero", "micro_batch", "recompute")
    assert [tuple(c[k] for k in keys) for c in result["planner"]["best"]] == \
        [tuple(c[k] for k in keys) for c in cli["configurations"][:sizing.TOP]]
    assert result["layout"]["rank"] == cli["layout"]["rank"]
    assert result["planner"]["count"] == len(cli["configurations"])


def test_a_mixture_of_experts_preset_is_planned_with_expert_parallelism():
    result = sizing.run({"model": "deepseek-v3", "gpus": "2048", "gpu_memory_gb": "80",
                         "global_batch_tokens": str(15360 * 4096),
                         "layout": "tp=1,pp=16,dp=128,ep=64"})
    assert result["model"]["active_params"] < result["model"]["params"] / 10
    assert result["layout"]["rank"] is not None and result["layout"]["ep"] == 64
    assert result["layout"]["etp"] == 1   # tp 1: the experts whole


@pytest.mark.parametrize("fields, words", [
    ({"model": "llama3-70b", "gpus": "many"}, "gpus: 'many' is not a whole number"),
    ({"model": "llama3-70b", "gpus": "0"}, "gpus: must be at least 1"),
    ({"model": "llama3-70b", "gpus": "12"}, "do not fill nodes of 8"),
    ({"model": "params", "params": "lots", "gpus": "8"}, "parameters:"),
    ({"model": "llama3-70b", "gpus": "8", "global_batch_tokens": "1000"}, "not a whole number"),
    ({"model": "llama3-70b", "gpus": "8", "layout": "tp=eight"}, "layout: not a layout"),
    ({"model": "shape", "layers": "2", "hidden": "100", "heads": "3", "vocab": "10",
      "gpus": "8"}, "hidden 100 is not divisible by heads 3"),
    ({"model": "gpt5", "gpus": "8"}, "model: choose a preset"),
    ({"model": "llama3-70b", "gpus": "8", "matmuls": "fp4"}, "matrix products: choose from"),
    ({"model": "llama3-70b", "gpus": "8", "tp_overlap": "all"},
     "tensor-parallel overlap: choose from"),
])
def test_bad_input_is_one_line(fields, words):
    with pytest.raises(sizing.SizingError) as error:
        sizing.run(fields)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_layout_that_does_not_fit_says_why():
    result = sizing.run({"model": "llama3-405b", "gpus": "8", "global_batch_tokens": "64K",
                         "layout": "tp=8,pp=1,dp=1"})
    assert result["layout"]["rank"] is None and "GB per GPU" in result["layout"]["reason"]


def load_sizing_page():
    """book/_ext/sizing_page.py, the build's extension, as a module."""
    import importlib.util
    import sys
    ext = Path(__file__).resolve().parent.parent / "book" / "_ext" / "sizing_page.py"
    spec = importlib.util.spec_from_file_location("sizing_page", ext)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sizing_page", module)
    spec.loader.exec_module(module)
    return module


def test_the_page_copies_the_predictions_folder_whole():
    """book/_ext/sizing_page.py copies labkit/predict/ as a folder: every module in it and
    in its subfolders (the planner is a package), and what they import stays inside it (a
    module elsewhere would be missing in the site)."""
    import ast
    module = load_sizing_page()
    predict = Path(sizing.__file__).parent
    labkit = predict.parent
    copied = module.site_modules(labkit)
    in_folder = {path.relative_to(labkit).with_suffix("").as_posix()
                 for path in predict.rglob("*.py") if "__pycache__" not in path.parts}
    assert set(copied) == in_folder | {"__init__"} and "predict/sizing" in copied
    assert {"predict/planner/__init__", "predict/planner/search"} <= set(copied)
    assert module.site_folders(copied) == ["predict", "predict/planner"]
    for name in copied:
        depth = name.count("/")   # folders below labkit/: a relative import climbs at most
        tree = ast.parse((labkit / f"{name}.py").read_text())   # to labkit/predict/
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= depth, f"{name} imports from outside labkit/predict/"
                assert node.level >= 1 or not (node.module or "").startswith("labkit"), name


def test_the_site_copy_imports_and_answers_without_torch(tmp_path):
    """What the build copies into the site (copy_into_site, run as the build runs it), set
    out as the page's script sets it out (each folder of the configuration made, each
    module written), imports in a fresh interpreter without torch and without the
    repository on its path, and answers the planner's question as here."""
    import subprocess
    import sys
    from types import SimpleNamespace
    module = load_sizing_page()
    repo = Path(__file__).resolve().parent.parent
    config = SimpleNamespace(sizing_pyodide_url="", sizing_pyodide_version="0",
                             sizing_pyodide_dir="")
    app = SimpleNamespace(builder=SimpleNamespace(format="html"), outdir=str(tmp_path / "site"),
                          srcdir=str(repo), config=config)
    module.copy_into_site(app, None)
    static = tmp_path / "site" / "_static"
    page = json.loads((static / "sizing-config.js").read_text().split("= ", 1)[1].rstrip(";\n"))
    home = tmp_path / "pyodide"
    for folder in ["", *page["folders"]]:                 # sizing.js: FS.mkdirTree
        (home / "labkit" / folder).mkdir(parents=True, exist_ok=True)
    for name in page["modules"]:                          # sizing.js: fetch, FS.writeFile
        (home / "labkit" / f"{name}.py").write_text((static / "labkit" / f"{name}.py").read_text())
    fields = {"model": "llama3-70b", "gpus": "256", "global_batch_tokens": "4M",
              "layout": "tp=8,pp=1,dp=32"}
    code = ("import json, sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "from labkit.predict import sizing; "
            "print(json.dumps(sizing.run(json.loads(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-I", "-c", code, str(home), json.dumps(fields)],
                          capture_output=True, text=True, check=True, cwd=tmp_path)
    there = json.loads(done.stdout)
    here = json.loads(json.dumps(sizing.run(fields)))
    assert there["planner"] == here["planner"] and there["layout"] == here["layout"]
