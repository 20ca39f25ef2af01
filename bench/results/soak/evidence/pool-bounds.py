import asyncio, subprocess, sys, time
import httpx2 as httpx
GW, P = sys.argv[1], sys.argv[2]
peak = 0
async def one(c, i):
    async with c.stream("POST", f"{GW}/v1/chat/completions", json={"model": "m", "stream": True, "max_tokens": 20,
        "messages": [{"role": "user", "content": f"hello {i} " * 20}]}) as r:
        async for _ in r.aiter_bytes():
            pass
        return r.status_code
async def sampler(stop):
    global peak
    while not stop.is_set():
        out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{P} )"], capture_output=True, text=True).stdout
        peak = max(peak, len(out.splitlines()))
        await asyncio.sleep(0.2)
async def main():
    stop = asyncio.Event()
    s = asyncio.create_task(sampler(stop))
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2000)) as c:
        codes = await asyncio.gather(*[one(c, i) for i in range(int(sys.argv[3]))], return_exceptions=True)
    stop.set(); await s
    from collections import Counter
    print(Counter(str(x) for x in codes), "peak established to worker:", peak)
asyncio.run(main())
import time as _t
for _ in range(3):
    _t.sleep(1)
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{P} )"], capture_output=True, text=True).stdout
    print("after burst, established:", len(out.splitlines()))
