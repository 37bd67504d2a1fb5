"""Adapters that change while the engine runs never corrupt the prefix cache nor end other requests:
a request checked against one adapter's weights runs with those weights or fails alone; a folder
rewritten on disk is refused at its next load; a file turned into a link under a root is refused;
cache salts separate tenants' blocks; a decompression bomb is refused unread (fp32, CPU)."""

import io
import os
import shutil
import time
import zipfile

import pytest
import torch
from helpers import PAD, build_pair
from lorazor import LoRazorConfig, LoRazorEngine
from lorazor.adapters import AdapterError
from test_prefix_cache import finish, tokens

GEN = dict(pad_token_id=PAD, eos_token_id=None, do_sample=False)
BS = 4


@pytest.fixture(scope="module")
def pair():
    return build_pair("llama", LoRazorConfig(cuda_graphs=False, max_loras=2, max_cpu_loras=0))


@pytest.fixture(scope="module")
def folders(pair, tmp_path_factory):
    """The PEFT oracle's sql and med adapters saved as folders."""
    _, oracle = pair
    root = tmp_path_factory.mktemp("saved")
    oracle.save_pretrained(root, selected_adapters=["sql", "med"])
    return root


def engine(model, **kw):
    return LoRazorEngine(model, **{"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 128,
                                   "block_size": BS, **kw})


def prompt(n=13, seed=0):
    return tokens(n, seed)


def run_alone(model, folder, ids, n=4):
    """The tokens `ids` get under the adapter of `folder` on a fresh registration, cache off."""
    model.register_adapter("alone", folder)
    try:
        eng = engine(model, enable_prefix_caching=False)
        return finish(eng, [eng.add_request(ids, adapter="alone", max_new_tokens=n, **GEN)])[0].token_ids
    finally:
        model.unregister_adapter("alone")


@pytest.fixture
def swap(pair, folders):
    """Adapter "swap" registered from a copy of the sql folder (removed after the test)."""
    model, _ = pair
    model.register_adapter("swap", folders / "sql")
    yield model
    if "swap" in model.adapter_names:
        model.unregister_adapter("swap")


def test_a_request_checked_before_a_reregistration_with_other_weights_fails_alone(swap, folders):
    model = swap
    eng = engine(model)
    ids = prompt()
    bystander = eng.add_request(prompt(9, 1), adapter="math", max_new_tokens=6, **GEN)
    eng.step()
    checked = eng.prepare_request(ids, adapter="swap", max_new_tokens=4, **GEN)
    model.register_adapter("swap", folders / "med", replace=True)  # between the check and the queueing
    with pytest.raises(AdapterError, match="registered again with other weights"):
        eng.queue_request(checked)
    # The bystander goes on; a request checked now runs on the new weights, as alone.
    fresh = eng.add_request(ids, adapter="swap", max_new_tokens=4, **GEN)
    out = dict(zip([bystander, fresh], finish(eng, [bystander, fresh])))
    assert out[bystander].finish_reason == "length" and out[fresh].finish_reason == "length"
    assert out[fresh].token_ids == run_alone(model, folders / "med", ids)
    assert model.registry.in_use.get("swap", 0) == 0


def test_the_same_files_registered_again_still_run(swap, folders):
    eng = engine(swap)
    checked = eng.prepare_request(prompt(), adapter="swap", max_new_tokens=3, **GEN)
    swap.register_adapter("swap", folders / "sql", replace=True)  # the same bytes: the same digest
    rid = eng.queue_request(checked)
    assert finish(eng, [rid])[0].finish_reason == "length"


def test_a_request_checked_before_an_unregister_fails_alone_and_the_step_goes_on(swap):
    eng = engine(swap)
    bystander = eng.add_request(prompt(9, 2), adapter="sql", max_new_tokens=5, **GEN)
    eng.step()
    checked = eng.prepare_request(prompt(), adapter="swap", max_new_tokens=4, **GEN)
    swap.unregister_adapter("swap")
    with pytest.raises(AdapterError, match="unregistered after this request was checked"):
        eng.queue_request(checked)
    assert finish(eng, [bystander])[0].finish_reason == "length"  # no KeyError aborts the others


def test_a_replacement_that_fails_its_checks_leaves_the_old_adapter_serving(swap, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        swap.register_adapter("swap", tmp_path, replace=True)
    assert "swap" in swap.adapter_names
    eng = engine(swap)
    assert finish(eng, [eng.add_request(prompt(), adapter="swap", max_new_tokens=2, **GEN)])[0].finish_reason == \
        "length"


def test_a_folder_rewritten_in_place_is_refused_and_its_cached_blocks_never_served(pair, folders, tmp_path):
    model, _ = pair  # max_loras=2, max_cpu_loras=0: every load after an eviction reads the folder again
    folder = tmp_path / "tenant"
    shutil.copytree(folders / "sql", folder)
    model.register_adapter("tenant", folder)
    try:
        eng = engine(model)
        ids = prompt(17, 3)
        first = finish(eng, [eng.add_request(ids, adapter="tenant", max_new_tokens=3, **GEN)])[0]
        assert first.finish_reason == "length"
        for name in ("med", "math"):  # evict "tenant" from both slots; no host copy is kept
            finish(eng, [eng.add_request(prompt(5, 4), adapter=name, max_new_tokens=1, **GEN)])
        assert "tenant" not in model.bank.slot_of
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            shutil.copy(folders / "med" / file, folder / file)  # a pipeline rewrites the folder in place
        again = finish(eng, [eng.add_request(ids, adapter="tenant", max_new_tokens=3, **GEN)])[0]
        assert again.finish_reason == "error" and "changed on disk" in again.error
        with pytest.raises(AdapterError, match="out of service"):
            eng.add_request(ids, adapter="tenant", max_new_tokens=3, **GEN)
        model.register_adapter("tenant", folder, replace=True)  # the operator registers it again
        fresh = finish(eng, [eng.add_request(ids, adapter="tenant", max_new_tokens=3, **GEN)])[0]
        assert fresh.num_cached_tokens == 0  # the old weights' blocks are not this digest's
        assert fresh.token_ids == run_alone(model, folders / "med", ids, 3)
    finally:
        model.unregister_adapter("tenant")


def test_two_salts_on_one_prompt_share_no_blocks_and_one_salt_hits(pair):
    model, _ = pair
    eng = engine(model)
    ids = prompt(17, 5)

    def cached(salt, adapter=None):
        kw = {} if salt is None else {"cache_salt": salt}
        rid = eng.add_request(ids, adapter=adapter, max_new_tokens=2, **kw, **GEN)
        return finish(eng, [rid])[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 16
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached(None) == 16
    assert cached("tenant-b", "sql") == 0 and cached("tenant-b", "sql") == 16
    for bad in ("", 7, "x" * 1025):
        with pytest.raises(ValueError, match="cache_salt"):
            eng.add_request(ids, cache_salt=bad, max_new_tokens=2, **GEN)


def test_a_file_turned_into_a_link_under_the_root_is_refused_at_its_next_read(pair, folders, tmp_path):
    model, _ = pair
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(folders / "sql", root / "linked")
    shutil.copytree(folders / "med", outside)
    registry = model.registry
    source = registry.read("linked", root / "linked", root=root.resolve())
    model.register_adapter("linked", root / "linked", source=source)
    try:
        weights = root / "linked" / "adapter_model.safetensors"
        weights.unlink()
        weights.symlink_to(outside / "adapter_model.safetensors")
        failed = registry.load_each(["linked"])
        assert "is a link" in failed["linked"]
    finally:
        model.unregister_adapter("linked")
    # A folder registered without a root (a local path the operator gave) may hold links (the Hub's cache does).
    os.symlink(outside, tmp_path / "hub_like")
    assert registry.read("plain", tmp_path / "hub_like").digest


def bomb(folder, megabytes=512):
    """A `.bin` adapter whose zip member is deflate-compressed: a few hundred KB that would expand to
    `megabytes` MB inside `torch.load`."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16, '
                                                '"target_modules": ["q_proj"]}')
    buffer = io.BytesIO()
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 4)}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as plain, \
            zipfile.ZipFile(folder / "adapter_model.bin", "w", zipfile.ZIP_DEFLATED) as packed:
        for info in plain.infolist():
            data = plain.read(info)
            if info.filename.endswith("/data/0"):
                data = bytes(megabytes << 20)
            packed.writestr(info.filename, data)


def test_a_decompression_bomb_is_refused_unread_in_under_a_second(pair, tmp_path):
    model, _ = pair
    bomb(tmp_path / "bomb", megabytes=256)
    assert (tmp_path / "bomb" / "adapter_model.bin").stat().st_size < 2 << 20
    start = time.perf_counter()
    with pytest.raises(AdapterError, match="compressed members"):
        model.registry.read("bomb", tmp_path / "bomb")
    assert time.perf_counter() - start < 1.0
    with pytest.raises(AdapterError, match="compressed members"):
        model.register_adapter("bomb", tmp_path / "bomb")
    assert "bomb" not in model.adapter_names


def test_an_uncompressed_file_past_the_models_bound_is_refused_unread(pair, tmp_path):
    model, _ = pair
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    big = torch.zeros(1 << 20, 4)  # 16 MB: far more than any adapter of the tiny model at max_lora_rank
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": big}, folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="more than an adapter of this model at max_lora_rank can need"):
        model.registry.read("big", folder)


def test_prepare_reads_a_consistent_snapshot_while_another_thread_changes_the_registry(swap, folders):
    """The snapshot is replaced whole: a reader never sees the name missing during a replacement."""
    import threading

    eng = engine(swap)
    stop, errors = threading.Event(), []

    def replace_again():
        while not stop.is_set():
            swap.register_adapter("swap", folders / ("med" if time.monotonic() % 2 < 1 else "sql"), replace=True)

    thread = threading.Thread(target=replace_again)
    thread.start()
    try:
        for i in range(200):
            try:
                eng.prepare_request(prompt(5, i), adapter="swap", max_new_tokens=1, request_id=f"r{i}", **GEN)
            except Exception as err:  # noqa: BLE001 - any error here is the race
                errors.append(err)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
