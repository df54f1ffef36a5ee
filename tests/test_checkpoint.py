"""Checkpoints load whatever they saved, refuse malformed or corrupted files clearly; every module pickles."""
import copy
import inspect
import io
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch

import e3attn
import e3attn.models
from e3attn import (
    EquivariantAttention,
    GraphMultiHeadAttention,
    IrrepsLinear,
    MultiHeadAttention,
    MultiHeadDot,
    RadialEmbedding,
    RadialMLP,
    SphericalHarmonics,
    SphericalTensorProduct,
)
from e3attn.models import (EquivariantLayerNorm, EquivariantTransformer, Gate, NeighbourDensity, load_checkpoint,
                           save_checkpoint)
from e3attn.models.checkpoint import _content_digest


def small_model():
    torch.manual_seed(0)
    return EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, num_layers=1, reduce="sum")


def test_numpy_extras_are_converted_and_load(tmp_path):
    path = tmp_path / "model.pt"
    extra = {
        "mae": np.float64(0.12), "count": np.int64(3), "flag": np.bool_(True), "name": np.str_("Cu"),
        "scale": np.float32(0.5), "table": np.arange(6, dtype=np.float32).reshape(2, 3),
        "nested": {"refs": [np.float64(1.5), (np.int32(2), "x")], 7: None},
    }
    save_checkpoint(small_model(), path, **extra)
    _, loaded = load_checkpoint(path)
    assert loaded["mae"] == 0.12 and type(loaded["mae"]) is float
    assert loaded["count"] == 3 and type(loaded["count"]) is int
    assert loaded["flag"] is True and type(loaded["name"]) is str
    assert loaded["scale"] == 0.5
    assert torch.equal(loaded["table"], torch.arange(6.0).reshape(2, 3))
    assert loaded["nested"] == {"refs": [1.5, (2, "x")], 7: None}


class Custom:
    pass


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"obj": Custom()}, r"extra 'obj' is a .*Custom; checkpoints hold"),
        ({"metrics": {"mae": [0.1, Custom()]}}, r"extra 'metrics'\['mae'\]\[1\] is a"),
        ({"arr": np.array([Custom()], dtype=object)}, r"extra 'arr' is a NumPy array of dtype object"),
        ({"keys": {(1, 2): 0}}, r"extra 'keys' has a key \(1, 2\) of type tuple"),
        ({"s": {1, 2}}, r"extra 's' is a builtins.set"),
    ],
)
def test_save_refuses_what_would_not_load_naming_the_key(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        save_checkpoint(small_model(), tmp_path / "model.pt", **extra)
    assert not (tmp_path / "model.pt").exists()


class Importable(torch.Tensor):
    """A tensor subclass that torch.load(weights_only=True) does not allow (only its data is stored)."""


class NoData(torch.Tensor):
    """A wrapper subclass whose every operation fails: there is no data to store."""

    @staticmethod
    def __new__(cls, size):
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"NoData has no {func}")


def test_tensor_subclasses_are_stored_as_plain_tensors(tmp_path):
    class Local(torch.Tensor):  # defined in a function: not picklable by reference
        pass

    values = torch.tensor([0.5, -2.0, 3.25])
    extra = {"norm": values.as_subclass(Local), "shift": values.as_subclass(Importable),
             "param": torch.nn.Parameter(values.clone()), "nested": [values.as_subclass(Local)]}
    save_checkpoint(small_model(), tmp_path / "model.pt", **extra)
    _, loaded = load_checkpoint(tmp_path / "model.pt")
    for got in (loaded["norm"], loaded["shift"], loaded["param"], loaded["nested"][0]):
        assert type(got) is torch.Tensor and not got.requires_grad
        assert torch.equal(got, values)


def test_a_subclass_without_data_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"extra 'weird'\[0\] is a .*NoData \(a tensor subclass\) whose data"):
        save_checkpoint(small_model(), tmp_path / "model.pt", weird=[NoData((3,))])
    assert list(tmp_path.iterdir()) == []


def test_numpy_long_double_and_zero_dimensional_arrays(tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(small_model(), path, mae=np.longdouble(0.125), z=np.clongdouble(0.5 - 2j), scale=np.array(0.25),
                    count=np.array(7, dtype=np.int16), swapped=np.array([1.5, -2.0], dtype=">f8"),
                    strided=np.arange(6.0)[::2])
    _, loaded = load_checkpoint(path)
    assert loaded["mae"] == 0.125 and type(loaded["mae"]) is float
    assert loaded["z"] == 0.5 - 2j and type(loaded["z"]) is complex
    assert loaded["scale"].shape == () and loaded["scale"].item() == 0.25 and loaded["scale"].dtype == torch.float64
    assert loaded["count"].shape == () and loaded["count"].item() == 7 and loaded["count"].dtype == torch.int16
    assert loaded["swapped"].tolist() == [1.5, -2.0] and loaded["strided"].tolist() == [0.0, 2.0, 4.0]
    if np.finfo(np.longdouble).nmant > np.finfo(np.float64).nmant:  # a long double wider than a float
        with pytest.raises(ValueError, match=r"extra 'metrics'\['mae'\] is a NumPy float128 scalar that a Python "
                                             r"float cannot hold exactly"):
            save_checkpoint(small_model(), tmp_path / "other.pt", metrics={"mae": np.longdouble(1) / 3})


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The file is written beside its target and renamed onto it only once complete: a write that fails midway
    (here: a full disk after a few bytes) leaves the previous checkpoint and no temporary file."""
    path = tmp_path / "model.pt"
    save_checkpoint(small_model(), path, energy_scale=0.5)
    before = path.read_bytes()

    def full_disk(obj, f, *args, **kwargs):
        f = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        f.write(b"PK\x03\x04 partial")
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(small_model(), path, energy_scale=0.7)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.pt"]
    assert load_checkpoint(path)[1] == {"energy_scale": 0.5}
    save_checkpoint(small_model(), path, energy_scale=0.7)  # a successful save replaces it
    assert load_checkpoint(path)[1] == {"energy_scale": 0.7} and [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def write(path, payload):
    torch.save(payload, path)
    return path


def good_payload(model):
    path = io.BytesIO()
    save_checkpoint(model, path)
    path.seek(0)
    return torch.load(path, weights_only=True)


def edited(model, **changes):
    """A checkpoint of ``model`` with ``changes`` (None: the entry removed), its content digest made again (unless
    given or removed) so that the checks after it are reached."""
    payload = good_payload(model)
    for key, value in changes.items():
        if value is None:
            del payload[key]
        else:
            payload[key] = value
    if "content_sha256" not in changes and all(key in payload for key in ("class", "config", "dtype", "extra")):
        payload["content_sha256"] = _content_digest(payload)
    return payload


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p, m: p.write_text("hello world"), "is not a checkpoint written by e3attn.models.save_checkpoint"),
        (lambda p, m: p.write_bytes(b""), "cannot read it"),
        (lambda p, m: p.write_bytes(bytes(range(256)) * 4), "cannot read it"),
        (lambda p, m: pickle.dump({"a": 1}, p.open("wb"), protocol=2), "cannot read it"),
        (lambda p, m: torch.save({"a": Custom}, p), "cannot read it"),
        (lambda p, m: torch.save({"weights": torch.zeros(2)}, p), "it has no e3attn format tag"),
        (lambda p, m: torch.save(edited(m, format="e3attn.models.checkpoint/0"), p), "its format is"),
        (lambda p, m: torch.save(edited(m, config=None), p), "damaged checkpoint: it has no 'config'"),
        (lambda p, m: torch.save(edited(m, **{"class": "Foo"}), p), "unknown class 'Foo'"),
        (lambda p, m: torch.save(edited(m, dtype="float99"), p), "invalid dtype 'float99'"),
        (lambda p, m: torch.save(edited(m, dtype="int64"), p), "invalid dtype 'int64'"),
        (lambda p, m: torch.save(edited(m, config={"foo": 1}), p), "config that does not build"),
        (lambda p, m: torch.save(edited(m, config=dict(m.config, num_layers=2)), p), "do not fit its config"),
        (lambda p, m: torch.save(edited(m, weights_sha256="0" * 64), p), "do not match the SHA-256 digest"),
        (lambda p, m: torch.save(edited(m, content_sha256=None), p), "damaged checkpoint: it has no 'content_sha256'"),
    ],
)
def test_malformed_files_give_one_clear_value_error(tmp_path, make, match):
    path = tmp_path / "bad.pt"
    make(path, small_model())
    with pytest.raises(ValueError, match=match) as info:
        load_checkpoint(path)
    assert "weights_only=False" not in str(info.value) and "weights_only` argument" not in str(info.value)
    shown = info.value.__cause__ or (None if info.value.__suppress_context__ else info.value.__context__)
    assert shown is None  # torch's text (which suggests weights_only=False) is not chained


def test_truncated_file_and_missing_file(tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(small_model(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read it"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "absent.pt")


def test_corrupted_weights_are_detected(tmp_path):
    path = tmp_path / "model.pt"
    model = small_model()
    save_checkpoint(model, path)
    with zipfile.ZipFile(path) as archive:  # the largest tensor's bytes, stored uncompressed
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little")
    start += int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")  # the local extra field
    data[start + 4] ^= 0x40  # flip one bit of one weight
    path.write_bytes(bytes(data))
    # torch alone loads it without complaint, and the model would predict differently
    tampered = torch.load(path, weights_only=True)["state_dict"]
    assert any(not torch.equal(tampered[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="corrupted: its weights do not match the SHA-256 digest"):
        load_checkpoint(path)


def test_round_trip_with_numpy_configuration(tmp_path):
    """NumPy scalars in the configuration end up as Python numbers in the checkpoint."""
    torch.manual_seed(0)
    model = EquivariantTransformer(
        "1x0e", "8x0e + 2x1o", "0e", np.float32(1.5), num_layers=np.int64(1), num_heads=np.int32(2), lmax=np.int64(1)
    )
    assert type(model.config["num_layers"]) is int and type(model.config["max_radius"]) is float
    save_checkpoint(model, tmp_path / "model.pt")
    loaded, _ = load_checkpoint(tmp_path / "model.pt")
    pos = torch.randn(6, 3)
    assert torch.equal(loaded(pos), model.eval()(pos))


def public_modules():
    """Every torch.nn.Module class that e3attn exports, with a small instance and its inputs."""
    torch.manual_seed(0)
    pos = torch.randn(7, 3)
    irreps = "4x0e + 2x1o"
    f = torch.randn(7, 10)
    layer = EquivariantAttention(irreps, irreps, irreps, irreps, 1.5, num_heads=2)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    tp = SphericalTensorProduct("2x0e + 1x1o", "1x0e + 1x1o", ["2x0e + 1x1o"])
    return {
        EquivariantAttention: (layer, lambda m: m(f, pos)),
        MultiHeadAttention: (MultiHeadAttention(8, 2), lambda m: m(torch.randn(3, 8, generator=gen()))),
        GraphMultiHeadAttention: (GraphMultiHeadAttention(8, 2, combine="gaan"),
                                  lambda m: m(torch.randn(4, 8, generator=gen()), edge_index)),
        RadialEmbedding: (RadialEmbedding(6, 1.5, "bessel"), lambda m: m(torch.linspace(0, 2, 9))),
        RadialMLP: (RadialMLP(6, 8, [3, 4]), lambda m: m(torch.randn(5, 6, generator=gen()))),
        SphericalTensorProduct: (tp, lambda m: m(torch.randn(5, 5, generator=gen()),
                                                 torch.randn(5, 4, generator=gen()), [torch.randn(5, m.weight_numel[0],
                                                                                                 generator=gen())])),
        SphericalHarmonics: (SphericalHarmonics(3), lambda m: m(pos)),
        IrrepsLinear: (IrrepsLinear(irreps, "3x0e + 1x1o"), lambda m: m(f)),
        MultiHeadDot: (MultiHeadDot("4x0e", "4x0e", 2), lambda m: m.project_query(torch.randn(3, 4, generator=gen()))),
        EquivariantTransformer: (small_model(), lambda m: m(pos)),
        EquivariantLayerNorm: (EquivariantLayerNorm(irreps), lambda m: m(f)),
        Gate: (Gate("2x0e + 1x0o + 2x1o"), lambda m: m(torch.randn(5, 11, generator=gen()))),
        NeighbourDensity: (NeighbourDensity(irreps, 8, max_radius=1.5),
                           lambda m: m(f, edge_index, pos[edge_index[0]] - pos[edge_index[1]])),
    }


def gen():
    return torch.Generator().manual_seed(1)


def exported_module_classes():
    found = set()
    for namespace in (e3attn, e3attn.models):
        for name in namespace.__all__:
            obj = getattr(namespace, name)
            if inspect.isclass(obj) and issubclass(obj, torch.nn.Module):
                found.add(obj)
    return found


def test_every_public_module_is_covered():
    assert set(public_modules()) == exported_module_classes()


def as_list(out):
    return [out] if isinstance(out, torch.Tensor) else list(out)


def torch_round_trip(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copy_of", [lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy, torch_round_trip],
                         ids=["pickle", "deepcopy", "torch.save"])
def test_every_public_module_round_trips_to_identical_outputs(copy_of):
    for cls, (module, run) in public_modules().items():
        module.eval()
        expected = as_list(run(module))
        twin = copy_of(module)
        assert type(twin) is cls
        for a, b in zip(as_list(run(twin)), expected):
            assert torch.equal(a, b), cls.__name__
        if cls is EquivariantAttention:  # the float64 constants survive too: same outputs after .double()
            assert torch.equal(as_list(run(twin.double().float()))[0], expected[0])




def test_checkpoints_of_format_1_still_load(tmp_path):
    """Files of the first format (no digest of the weights) load, with a warning that they are unverified."""
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 1.5, reduce="sum")
    path = tmp_path / "old.pt"
    torch.save({"format": "e3attn.models.checkpoint/1", "class": "EquivariantTransformer", "config": model.config,
                "dtype": "float32", "state_dict": model.state_dict(), "extra": {"energy_scale": 0.5}}, path)
    with pytest.warns(UserWarning, match="without a digest"):
        loaded, extra = load_checkpoint(path)
    assert extra == {"energy_scale": 0.5}
    pos = torch.randn(5, 3)
    torch.testing.assert_close(loaded(pos), model.eval()(pos), atol=0, rtol=0)


@pytest.mark.parametrize("change", [
    lambda c: c["extra"].update(energy_scale=0.15),  # one bit of the float flipped
    lambda c: c["extra"]["species"].__setitem__(1, "Au"),
    lambda c: c["config"].update(max_radius=3.0039),
    lambda c: c["extra"].update(note="y"),
    lambda c: c["extra"].update(table=c["extra"]["table"] + 1),
    lambda c: c.update(dtype="float64"),
])
def test_corrupted_configuration_and_extras_are_detected(tmp_path, change):
    """Not only the weights: a changed configuration, dtype or extra (the energy scale, the elements) would predict
    differently and torch.load reads it without complaint; the content digest refuses it."""
    model = EquivariantTransformer("1x0e", "8x0e + 2x1o", "0e", 3.0, num_layers=1, reduce="sum")
    path = tmp_path / "model.pt"
    save_checkpoint(model, path, species=["Cu", "Ni"], energy_scale=0.3, note="x", table=torch.arange(3.0))
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)
    with pytest.raises(ValueError, match="corrupted: its class, config, dtype or extras do not match the SHA-256"):
        load_checkpoint(path)


def test_content_digest_tells_types_and_orders_apart():
    base = {"class": "EquivariantTransformer", "config": {"a": 1, "b": [1.0, "x"]}, "dtype": "float32", "extra": {}}
    digest = _content_digest(base)
    assert digest == _content_digest({**base, "config": {"b": [1.0, "x"], "a": 1}})  # dict order is not content
    for other in ({"a": 1.0, "b": [1.0, "x"]}, {"a": True, "b": [1.0, "x"]}, {"a": 1, "b": (1.0, "x")},
                  {"a": 1, "b": [1.0, "x", None]}, {"a": 1, "b": [float.fromhex("0x1.0000000000001p+0"), "x"]}):
        assert _content_digest({**base, "config": other}) != digest


def test_checkpoints_of_format_2_still_load(tmp_path):
    """Files of the second format (a digest of the weights only) load, their weights verified."""
    model = small_model()
    payload = edited(model, format="e3attn.models.checkpoint/2", content_sha256=None)
    path = tmp_path / "v2.pt"
    torch.save(payload, path)
    loaded, extra = load_checkpoint(path)
    pos = torch.randn(5, 3)
    torch.testing.assert_close(loaded(pos), model.eval()(pos), atol=0, rtol=0)
    torch.save({**payload, "weights_sha256": "0" * 64}, path)
    with pytest.raises(ValueError, match="its weights do not match"):
        load_checkpoint(path)


def test_file_objects_load_as_they_save(tmp_path):
    model = small_model()
    buffer = io.BytesIO()
    save_checkpoint(model, buffer, energy_scale=0.5)
    buffer.seek(0)
    loaded, extra = load_checkpoint(buffer)
    assert extra == {"energy_scale": 0.5}
    with open(tmp_path / "model.pt", "wb") as file:
        save_checkpoint(model, file)
    with open(tmp_path / "model.pt", "rb") as file:
        load_checkpoint(file)
    with pytest.raises(ValueError, match="the file object 'BytesIO' is not a checkpoint"):
        load_checkpoint(io.BytesIO(b"nothing"))
    for bad in (None, 3):
        with pytest.raises(TypeError, match=f"path must be a file path or a binary file object, got {type(bad).__name__}"):
            load_checkpoint(bad)
    with pytest.raises(ValueError, match="map_location must be a torch device"):
        load_checkpoint(tmp_path / "model.pt", map_location="gpu0")


@pytest.mark.skipif(os.name != "posix", reason="symbolic links and permission bits of POSIX")
def test_saving_again_writes_through_a_link_and_keeps_the_permissions(tmp_path):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "v1.pt"
    save_checkpoint(small_model(), target, note="first")
    os.chmod(target, 0o600)
    link = tmp_path / "current.pt"
    link.symlink_to(os.path.join("store", "v1.pt"))
    save_checkpoint(small_model(), link, note="second")
    assert link.is_symlink() and load_checkpoint(target)[1] == {"note": "second"}
    assert oct(target.stat().st_mode & 0o777) == oct(0o600)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["current.pt", "store", "v1.pt"]  # no temporary left


@pytest.mark.parametrize("value", [
    torch.tensor([1 + 2j, 3j]).conj(), torch.tensor([1 + 2j, 3j]).conj().imag, torch.eye(3).to_sparse(),
    torch.arange(6.0).reshape(2, 3).t(),
    torch.zeros(2, device="meta"), torch.ones(2, dtype=torch.bool), torch.zeros(3, dtype=torch.bfloat16),
])
def test_extras_of_any_tensor_kind_save_load_and_are_verified(tmp_path, value):
    """Conjugate and negative views, sparse, transposed and meta tensors: digested as they load back."""
    path = tmp_path / "model.pt"
    save_checkpoint(small_model(), path, x=value, y=1)
    assert load_checkpoint(path)[1]["y"] == 1
    payload = torch.load(path, weights_only=True)
    payload["extra"]["y"] = 2
    torch.save(payload, path)
    with pytest.raises(ValueError, match="do not match the SHA-256"):
        load_checkpoint(path)


def test_entries_that_cannot_be_digested_are_a_damaged_file(tmp_path):
    path = tmp_path / "model.pt"
    payload = edited(small_model())
    payload["extra"] = {(1, "a"): 1, (1, 2): 2}  # keys that do not compare (no checkpoint written by e3attn)
    torch.save(payload, path)
    with pytest.raises(ValueError, match="do not match the SHA-256"):
        load_checkpoint(path)
