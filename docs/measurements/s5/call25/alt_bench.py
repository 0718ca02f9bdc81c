"""Run bench/fused_decode_bench.py against another copy of decode_layers.py (argv[1]); the rest of argv goes to it."""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("qual.runtime.kernels.decode_layers", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
sys.argv = ["bench/fused_decode_bench.py", *sys.argv[2:]]
sys.path.insert(0, "bench")
exec(compile(open("bench/fused_decode_bench.py").read(), "bench/fused_decode_bench.py", "exec"), {"__name__": "__main__", "__file__": "bench/fused_decode_bench.py"})
