#!/bin/bash
# Peak RSS of `strata serve` as scripts/bench_peer.py starts it (4 slots, 1024 tokens each, 2 threads, 64 MiB
# conversation cache): VmHWM / RssAnon / RssFile after start and after one 32-token chat request, then the
# mappings holding more than 8 MiB. Usage: bash scripts/rss_serve.sh MODEL PORT [more serve flags] (from the
# repository root).
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 .venv/bin/strata serve --model $1 --port $2 --batch 4 --ctx-size 1024 --threads 2 --conversation-cache-mib 64 "${@:3}" > "${TMPDIR:-/tmp}/rss_serve_$1.log" 2>&1 &
PID=$!
for i in $(seq 1 240); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$2/health 2>/dev/null | grep -q 200 && break; sleep 1; done
echo "after start:"; grep -E "VmHWM|VmRSS|RssAnon|RssFile" /proc/$PID/status | tr -s ' ' | tr '\n' ' '; echo
curl -s http://127.0.0.1:$2/v1/chat/completions -H 'content-type: application/json' -d "{\"model\":\"$1\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story about a cat.\"}],\"max_tokens\":32}" | head -c 300; echo
echo "after a request:"; grep -E "VmHWM|VmRSS|RssAnon|RssFile" /proc/$PID/status | tr -s ' ' | tr '\n' ' '; echo
awk '/^[0-9a-f]+-[0-9a-f]+ /{name=$6} /^Rss:/{rss[name]+=$2} END{for(n in rss) if (rss[n]>8000) print rss[n]/1024 " MiB", n}' /proc/$PID/smaps | sort -rn | head -12
kill $PID; wait $PID 2>/dev/null
