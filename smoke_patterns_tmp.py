import time,torch
from sparsesearch.patterns import *
from sparsesearch.patterns import ashape,grid,triangle,dense,block_topk as bt,vertical_slash as vs
def eq(a,b):
    for n in ("full_count","full_idx","partial_count","partial_idx","col_count","col_idx"):
        x,y=getattr(a,n),getattr(b,n)
        assert (x is None)==(y is None),n
        if x is not None: assert torch.equal(x.cpu(),y.cpu()),n
def t(f):
    f();torch.cuda.synchronize();s=time.perf_counter();r=f();torch.cuda.synchronize();return r,(time.perf_counter()-s)*1e3
for mod,p in [(dense,dense.DenseParams()),(ashape,ashape.AShapeParams(100,300)),(triangle,triangle.TriangleParams(8,200,128)),(grid,grid.GridParams(37,5,True,True,True,64))]:
    eq(mod.build_index(p,1000,1333,heads=2,block_m=64,block_n=32,device="cuda"),mod.build_index(p,1000,1333,heads=2,block_m=64,block_n=32))
torch.manual_seed(0)
q,k=torch.randn(2,8,700,64),torch.randn(2,4,900,64)
for hs in ("query","kv"):
    eq(vs.build_index(vs.VerticalSlashParams(40,60),q.cuda(),k.cuda(),head_space=hs),vs.build_index(vs.VerticalSlashParams(40,60),q,k,head_space=hs))
    eq(bt.build_index(bt.BlockTopKParams(4),q.cuda(),k.cuda(),head_space=hs,block_m=32),bt.build_index(bt.BlockTopKParams(4),q,k,head_space=hs,block_m=32))
print("cuda==cpu ok")
n=131072
for mod,p in [(dense,dense.DenseParams()),(ashape,ashape.AShapeParams(128,4096)),(triangle,triangle.TriangleParams()),(grid,grid.GridParams(196,0,True,True,False,1024))]:
    _,ms=t(lambda:mod.build_index(p,n,device="cuda",heads=32));print(mod.NAME,n,f"{ms:.1f} ms density {mod.density(p,n):.4f}")
q=torch.randn(1,32,n,128,device="cuda",dtype=torch.bfloat16);k=torch.randn(1,8,n,128,device="cuda",dtype=torch.bfloat16)
for hs in ("kv","query"):
    torch.cuda.reset_peak_memory_stats()
    idx,ms=t(lambda:vs.build_index(vs.VerticalSlashParams(1000,6096),q,k,head_space=hs));print("vs",hs,f"{ms:.1f} ms peak {torch.cuda.max_memory_allocated()/2**30:.1f} GiB density {index_density(idx,n):.4f}")
    idx,ms=t(lambda:bt.build_index(bt.BlockTopKParams(16),q,k,head_space=hs));print("block_topk",hs,f"{ms:.1f} ms")
