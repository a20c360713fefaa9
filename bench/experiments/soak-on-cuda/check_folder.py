"""The soak's disk folder (/tmp/soak-disk, run.sh's) checked against fresh forwards in a
process whose MLX_ENABLE_TF32 is argv[1]: `python check_folder.py 0`, then `1`."""
import glob
import os
import sys
from pathlib import Path

os.environ["MLX_ENABLE_TF32"] = sys.argv[1]
import mlx_lm

from tests.engine.kv_integrity import check_folder_kv

model = mlx_lm.load(glob.glob("/root/.cache/radix-mlx/gguf/*/SmolLM2-135M-Instruct.Q4_1")[0])[0]
(folder,) = [p for p in Path("/tmp/soak-disk").iterdir() if p.is_dir()]
wrong = check_folder_kv(folder, model)
print(f"TF32={sys.argv[1]}: {len(list(folder.glob('*.safetensors')))} files, {len(wrong)} wrong")
for line in wrong[:3]:
    print(" ", line)
