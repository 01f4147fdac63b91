"""Which b_max to trace at (label.trace_block_size): the rules and the per-step oracle simulated on a label set's
val split, at the traced b_max and, approximately, at smaller ones (a trace at 16 cut to b_max - 1 slots: the
draft's proposals at a smaller block differ, so this only ranks b_max; the exact figures come from a trace at that
b_max). Usage: python benchmarks/trace_block_size.py RUN_DIR (a run with labels at trace b_max 16)."""
import sys
RUN = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dev1"
import glob, time, numpy as np, pyarrow.parquet as pq
from pipeline.policy.trace import Trace
from pipeline.policy.blocksize import split_of
from pipeline.policy.acceptance import fit_acceptance, reliability
from pipeline.policy.step_rules import LearnedVerify, parse_rule
from pipeline.policy.simulate import pack_traces, simulate_many, per_step_oracle
from pipeline.policy.cost import CostProfile
t0=time.time()
rows=[]
for f in sorted(glob.glob(RUN + '/labels/part-*.parquet')):
    rows += pq.read_table(f, columns=['prompt_id','prompt_tokens','candidates','steps','new_tokens','trace_block_size','trace_stopped','trace_match','trace_confidence']).to_pylist()
print('read', len(rows), time.time()-t0)
prof=CostProfile.load(RUN + '/labels/cost_profile.json')
VF=0.3
tr=[r for r in rows if split_of(r['prompt_id'],VF,0.15)!='val']; va=[r for r in rows if split_of(r['prompt_id'],VF,0.15)=='val']
print(len(tr),len(va))
T=lambda rs:[Trace.from_row(r) for r in rs]
ttr,tva=T(tr),T(va)
t0=time.time(); m=fit_acceptance(ttr); print('fit',time.time()-t0, dict(m.info)); print(dict(zip(m.features,np.round(m.weights,3))), m.intercept)
rel=reliability(m,tva); print({k:v for k,v in rel.items() if k!='table'})
for r in rel['table']: print(r)
B=16
packed=pack_traces(tva,128)
def secs(sim, rule=True):
    return sum(prof.decode_seconds(v,B,rule=rule,context=r['prompt_tokens']) for v,r in zip(sim.verified,va))
tok=sum(t.new_tokens for t in tva)
cands=va[0]['candidates']
def fixed(b):
    i=cands.index(b); return sum(r['steps'][i]*prof.cost(b)+prof.first_step_seconds(b,r['prompt_tokens']) for r in va)
base=fixed(8)
print('fixed', {b: round(base/fixed(b)-1,4) for b in cands})
full=simulate_many(packed,parse_rule('full')); print('full@16', base/secs(full,False)-1)
for t in (0.002,0.005,0.01,0.02,0.05,0.1):
    t0=time.time(); s=simulate_many(packed,parse_rule(f'threshold:{t}')); print('thr',t, round(base/secs(s)-1,4), round(time.time()-t0,2))
lr=LearnedVerify.from_profile(m,prof,B)
t0=time.time(); s=simulate_many(packed,lr); print('learned', round(base/secs(s)-1,4), round(time.time()-t0,2))
steps=lr.step_seconds
t0=time.time(); o=[per_step_oracle(t,steps) for t in tva]; 
print('oracle', base/sum(prof.decode_seconds(v,B,rule=True,context=r['prompt_tokens']) for v,r in zip(o,va))-1, time.time()-t0)
print('---- truncated (approximate) b_max')
def trunc(t,bm): return Trace(bm,[min(m,bm-1) for m in t.match],[list(c[:bm-1]) for c in t.confidence],t.stopped)
for bm in (8,10,12):
    a=[trunc(t,bm) for t in tva]; atr=[trunc(t,bm) for t in ttr]
    pk=pack_traces(a,128)
    def secs(sim):
        return sum(prof.decode_seconds(v,bm,rule=True,context=r['prompt_tokens']) for v,r in zip(sim.verified,va))
    mm=fit_acceptance(atr)
    res={}
    for t in (0.005,0.01,0.02,0.05,0.1,0.2):
        res[t]=round(base/secs(simulate_many(pk,parse_rule(f'threshold:{t}')))-1,4)
    lr=LearnedVerify.from_profile(mm,prof,bm)
    o=[per_step_oracle(t,lr.step_seconds) for t in a]
    print(bm,'thr',res,'learned',round(base/secs(simulate_many(pk,lr))-1,4),'oracle',round(base/sum(prof.decode_seconds(v,bm,rule=True,context=r['prompt_tokens']) for v,r in zip(o,va))-1,4))
