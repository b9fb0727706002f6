import torch
B,H,G,D,M=64,8,4,128,1025
u=torch.randn(B,H,M,D,device="cuda",dtype=torch.bfloat16); q=torch.randn(B,H,G,D,device="cuda",dtype=torch.bfloat16)
fns={"q@uT":lambda: torch.matmul(q,u.transpose(-1,-2)),"u@qT":lambda: torch.matmul(u,q.transpose(-1,-2)),"einsum":lambda: torch.einsum("bhgd,bhmd->bhgm",q,u)}
for n,f in fns.items():
    f(); torch.cuda.synchronize(); s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True); s.record()
    for _ in range(50): f()
    e.record(); e.synchronize(); ms=s.elapsed_time(e)/50; print(n, round(ms*1000,1), "us", round(u.numel()*2/ms/1e9,1), "GB/s")
