import math

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.zoo import ZOO, load_model, zoo_names


def test_the_zoo_has_the_models_users_ask_for():
    assert set(zoo_names()) == {"gpt2", "gpt2-tiny", "bert-base", "llama-tiny", "resnet50", "vit-base",
                                "inception-tiny", "mlp", "ctr-dnn"}
    assert all(entry.summary for entry in ZOO.values())


@pytest.mark.parametrize("name,params_m,kw", [
    ("gpt2", (124.0, 124.8), {"seq_len": 8}),          # GPT-2 small: 124.4M (lm_head tied to wte)
    ("bert-base", (109.0, 110.5), {"seq_len": 8}),     # BERT base with its MLM head
    ("resnet50", (25.4, 25.7), {}),                    # ResNet-50: 25.6M
    ("vit-base", (86.0, 86.9), {}),                    # ViT-B/16 with a 1000-class head: 86.6M
    ("gpt2-tiny", (0.5, 1.5), {"seq_len": 8}),
    ("llama-tiny", (0.5, 1.5), {"seq_len": 8}),
    ("inception-tiny", (0.01, 0.5), {}),
    ("mlp", (3.9, 4.0), {}),
    ("ctr-dnn", (89.49, 89.50), {}),                   # 5.57M table rows x 16 + the MLP (test below)
])
def test_models_are_the_real_architectures(name, params_m, kw):
    zm = load_model(name, batch_size=1, **kw)
    unique = {id(p): p for p in zm.step.parameters()}
    count = sum(p.numel() for p in unique.values()) / 1e6
    assert params_m[0] <= count <= params_m[1], count
    with torch.no_grad():
        loss = zm.step.eval()(**zm.batch)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert zm.block_classes


def test_ctr_dnn_has_the_capped_kaggle_tables():
    """26 tables: the Kaggle data set's ids per field, capped at 1M rows (5.57M rows, 356 MB at fp32),
    with 16 dimensions; then the 429-512-256-128-1 MLP."""
    from hetplan.zoo.criteo import DEFAULT_TABLES, KAGGLE_ROWS

    assert tuple(min(r, 1_000_000) for r in KAGGLE_ROWS) == DEFAULT_TABLES and sum(DEFAULT_TABLES) == 5_569_296
    zm = load_model("ctr-dnn", batch_size=2)
    bags = {n: m for n, m in zm.step.named_modules() if isinstance(m, torch.nn.EmbeddingBag)}
    assert sorted(m.num_embeddings for m in bags.values()) == sorted(DEFAULT_TABLES)
    mlp = (13 + 26 * 16) * 512 + 512 + 512 * 256 + 256 + 256 * 128 + 128 + 128 + 1
    assert sum(p.numel() for p in zm.step.parameters()) == sum(DEFAULT_TABLES) * 16 + mlp == 89_493_249
    assert zm.batch["lines"].dtype == torch.uint8 and zm.batch["lines"].shape == (2, 384)
    assert ZOO["ctr-dnn"].default_batch_size == 256 and not ZOO["ctr-dnn"].language_model


def test_batches_follow_the_requested_shape():
    zm = load_model("gpt2-tiny", batch_size=3, seq_len=10)
    assert zm.batch["input_ids"].shape == (3, 10)
    assert load_model("inception-tiny", batch_size=5).batch["x"].shape == (5, 3, 32, 32)
    a, b = load_model("mlp", batch_size=2, seed=7), load_model("mlp", batch_size=2, seed=7)
    assert torch.equal(a.batch["x"], b.batch["x"])


def test_bad_names_and_sizes():
    with pytest.raises(HetplanError, match=r"unknown model 'gpt3' \(zoo: gpt2, gpt2-tiny, bert-base"):
        load_model("gpt3")
    with pytest.raises(HetplanError, match="takes 1 to 512 positions"):
        load_model("gpt2-tiny", seq_len=4096)
    with pytest.raises(HetplanError, match="--batch-size 0"):
        load_model("mlp", batch_size=0)
    with pytest.raises(HetplanError, match="no module 'no_such_module' in the current folder"):
        load_model("no_such_module:make")
    with pytest.raises(HetplanError, match="has no callable 'nothing'"):
        load_model("user_models:nothing")


def test_user_model_from_a_factory():
    zm = load_model("user_models:make", batch_size=3)
    assert zm.batch["x"].shape == (3, 8)
    assert zm.step(**zm.batch).dim() == 0


def test_a_users_module_is_found_in_the_current_folder_as_python_m_finds_it(tmp_path, monkeypatch):
    """`hetplan profile mymodels:make` in the module's folder (`No module named 'mymodels'`)."""
    import sys

    (tmp_path / "mymodels_i13.py").write_text(
        "import torch\n\ndef make(batch_size=2, seq_len=None):\n"
        "    return torch.nn.Linear(3, 1), {'input': torch.randn(batch_size, 3)}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_model("mymodels_i13:make", batch_size=2).batch["input"].shape == (2, 3)
    with pytest.raises(HetplanError, match=r"no module 'nowhere_i13' in the current folder \(.*\) or on the Python"):
        load_model("nowhere_i13:make")
