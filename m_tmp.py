import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from lctrain.attention import usp_attention, shard_sequence, unshard_sequence
from lctrain.attention.kernels import reference_attention
from tests.distributed.spawn import run_distributed

def inputs(S):
    g = torch.Generator().manual_seed(3)
    B,H,D=1,8,64
    return [torch.randn(B,S,H,D,generator=g).bfloat16() for _ in range(4)]

def job(R, U, S):
    mesh = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
    rg, ug = mesh.get_group("ring"), mesh.get_group("ulysses")
    r, u = mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses")
    q,k,v,do = inputs(S)
    sh = lambda x: shard_sequence(x, dim=1, ring_rank=r, ring_size=R, ulysses_rank=u, ulysses_size=U).clone().requires_grad_()
    ql,kl,vl = sh(q),sh(k),sh(v)
    o = usp_attention(ql,kl,vl, ulysses_group=ug, ring_group=rg); o.backward(sh(do).detach())
    def gather(x):
        xs=[torch.empty_like(x) for _ in range(R*U)]; dist.all_gather(xs, x.contiguous())
        return unshard_sequence(xs, dim=1, ring_size=R, ulysses_size=U)
    return [gather(t) for t in (o.detach(), ql.grad, kl.grad, vl.grad)]

def rel(a,b): return ((a.double()-b).norm()/b.norm()).item()
def mx(a,b): return (a.double()-b).abs().max().item()
if __name__ == "__main__":
    R, U, S = map(int, sys.argv[1:])
    dist_res = run_distributed(job, R*U, R, U, S)[0]
    q,k,v,do = inputs(S)
    q64,k64,v64=[t.double().requires_grad_() for t in (q,k,v)]
    ref = reference_attention(q64,k64,v64,causal=True); ref.backward(do.double()); refs=[ref.detach(), q64.grad,k64.grad,v64.grad]
    qb,kb,vb=[t.clone().requires_grad_() for t in (q,k,v)]
    sd = F.scaled_dot_product_attention(qb.transpose(1,2),kb.transpose(1,2),vb.transpose(1,2),is_causal=True).transpose(1,2); sd.backward(do)
    single=[sd.detach(), qb.grad, kb.grad, vb.grad]
    for name,a,b,c in zip("o q k v".split(), dist_res, single, refs):
        print(name, "rel dist %.3e single %.3e ratio %.2f | max dist %.3e single %.3e ratio %.2f" % (rel(a,c), rel(b,c), rel(a,c)/rel(b,c), mx(a,c), mx(b,c), mx(a,c)/mx(b,c)))
