"""The bundled tiny pair's acceptance and modelled speedup by temperature: mean tau at b = 4, 8, 12 over 20 bundled
label prompts (64 new tokens, two sampled decodes each at T > 0), and tau x cost(1) / cost(b) under a cost profile.

    python benchmarks/tiny_pair_temperature.py COST_PROFILE.json
"""
import argparse

_args = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_args.add_argument("cost_profile", help="a cost_profile.json (e.g. runs/default/labels/cost_profile.json)")
ARGS = _args.parse_args()
import sys, torch, numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from label_noise import label_prompts
from pipeline.decoding.engine import Engine
from pipeline.decoding.models import load_models
from pipeline.policy.cost import CostProfile
from pipeline.runtime.config import load_config
torch.set_num_threads(1); torch.manual_seed(0)
m = load_models(load_config([]).model)
e = Engine(m.target, m.draft, m.stop_token_ids)
prof = CostProfile.load(ARGS.cost_profile)
prompts = label_prompts(m.tokenizer, 20, 256)
states = [e.prefill(torch.tensor([p])) for p in prompts]
print("T     mean tau at b=4 / 8 / 12     modelled speedup over AR at b=4 / 8 / 12")
for T in (0.0, 0.3, 0.5, 0.7, 1.0):
    tau = {b: np.mean([e.decode(s, block_size=b, max_new_tokens=64, temperature=T, seed=None).tau for s in states for _ in range(2 if T > 0 else 1)]) for b in (4, 8, 12)}
    sp = {b: tau[b] * prof.cost(1) / prof.cost(b) for b in tau}
    print(f"{T:<5} {tau[4]:.2f} / {tau[8]:.2f} / {tau[12]:.2f}               {sp[4]:.2f}x / {sp[8]:.2f}x / {sp[12]:.2f}x", flush=True)
