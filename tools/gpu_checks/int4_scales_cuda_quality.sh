# allot: 150
# q4qual: int4 of the default model on CUDA with the shipped importance file's input scales
# (staged load: the fold on the device), against unscaled and float; the passage, 668 positions
python3 - <<'PY'
import sys, time, torch
sys.path.insert(0, "tools")
import quant_quality as qq
from safetensors.torch import load_file, save_file
from worker.layers.quant import pack_for_device
from worker.loading.loader import load_model
from worker.loading.quantize import SCALE_SUFFIX, SHIPPED_IMPORTANCE, QuantizeOptions
stats = load_file(SHIPPED_IMPORTANCE)
save_file({k: v for k, v in stats.items() if not k.endswith(SCALE_SUFFIX)}, "/tmp/unscaled.safetensors")
for dtype in (torch.float32, torch.bfloat16):
    ref = None
    for label, mode, imp in [("float", "none", None), ("int4 scaled", "int4", None),
                             ("int4 unscaled", "int4", "/tmp/unscaled.safetensors"),
                             ("int4-mixed scaled", "int4-mixed", None)]:
        t0 = time.time()
        loaded = load_model(None, "cuda", dtype, progress=False, quantize=QuantizeOptions(mode, 32 if mode != "none" else None, imp))
        load_s = time.time() - t0
        model = loaded.model
        if mode != "none":
            model.fuse_projections(); pack_for_device(model)
        ids = qq.passage_ids(loaded.tokenizer, None)
        got = qq.teacher_forced(model, ids)
        if ref is None: ref = got
        q = qq.compare(ref, got, label)
        print(f"{str(dtype)[6:]:9} {label:18} load {load_s:5.1f}s top-1 {q.top1_agreement:.2%} ppl {q.perplexity:.3f} {q.perplexity_increase:+.2%}", flush=True)
        del loaded, model; torch.cuda.empty_cache()
PY
