import torch
from tests.test_context_parallel_memory import _cp_rank
from torchtitan_amp.models.llama3.model import repeat_kv
cp, seq, n_rep = 2, 32, 2
torch.manual_seed(0)
q0 = torch.randn(2, 4, seq // cp, 8)
kv0 = torch.randn(2, seq, 2, 8), torch.randn(2, seq, 2, 8)
outs = []
for grouped in (True, False):
    q = q0.clone().requires_grad_()
    k, v = (t.clone().requires_grad_() for t in kv0)
    kk, vv = (k, v) if grouped else (repeat_kv(k, n_rep), repeat_kv(v, n_rep))
    out = _cp_rank(cp, 1).causal_attention(q, kk.transpose(1, 2), vv.transpose(1, 2), enable_gqa=grouped)
    out.square().sum().backward()
    outs.append((out, q.grad, k.grad, v.grad))
print([(torch.equal(a,b),(a-b).abs().max().item()) for a, b in zip(*outs)])
# contiguous variant
outs=[]
for grouped in (True, False):
    q = q0.clone().requires_grad_()
    k, v = (t.clone().requires_grad_() for t in kv0)
    kk, vv = (k, v) if grouped else (repeat_kv(k, n_rep), repeat_kv(v, n_rep))
    out = _cp_rank(cp, 1).causal_attention(q, kk.transpose(1, 2).contiguous(), vv.transpose(1, 2).contiguous(), enable_gqa=grouped)
    out.square().sum().backward()
    outs.append((out, q.grad, k.grad, v.grad))
print([(torch.equal(a,b),(a-b).abs().max().item()) for a, b in zip(*outs)])
