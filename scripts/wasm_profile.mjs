// Where the filter's own code spends its time per request, by wasm function: the built .wasm run
// under Node's V8 (the engine Envoy embeds) with a minimal in-process host, then V8's CPU
// profile summed per function. A profiling aid, not a test and not a figure about Envoy: the host
// here is a few lines of JavaScript, so the calls into it cost far less than Envoy's, and only
// the split of the filter's own code means anything (Envoy's per-request instruction count is
// scripts/envoy_instructions.py).
//
// The request is the one scripts/envoy_overhead.py sends (its 4 KB chat body), routed against a
// snapshot of 8 equally loaded pods; every request must be picked, or the run fails.
//
// Usage: make profile-wasm, or
//        node --cpu-prof --cpu-prof-dir=DIR scripts/wasm_profile.mjs FILTER.wasm BODY.json [N [PATH]]
//        then scripts/wasm_profile_report.py DIR/*.cpuprofile
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import process from 'node:process';

const [wasmPath, bodyPath, n = '200000', reqPath = '/v1/chat/completions'] = process.argv.slice(2);
const body = new Uint8Array(await readFile(bodyPath));
const enc = new TextEncoder();
const dec = new TextDecoder();
let inst;
const mem = () => new Uint8Array(inst.exports.memory.buffer);
const view = () => new DataView(inst.exports.memory.buffer);

// The host's state.
const shared = new Map(); // key -> {value: Uint8Array, cas}
const metricNames = [];
const counters = new Map();
let cas = 1;
let config = new Uint8Array();
let headers = new Uint8Array();
let requestBody = new Uint8Array();
let clock = 1_700_000_000_000_000_000n;

function give(bytes, ptrPtr, sizePtr) {
  const p = inst.exports.proxy_on_memory_allocate(bytes.length);
  mem().set(bytes, p);
  view().setUint32(ptrPtr, p, true);
  view().setUint32(sizePtr, bytes.length, true);
}
function str(p, l) {
  return dec.decode(mem().subarray(p, p + l));
}
function headerMap(pairs) {
  const parts = pairs.map(([k, v]) => [enc.encode(k), enc.encode(v)]);
  let size = 4 + parts.length * 8;
  for (const [k, v] of parts) size += k.length + v.length + 2;
  const out = new Uint8Array(size);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, parts.length, true);
  let at = 4 + parts.length * 8;
  parts.forEach(([k, v], i) => {
    dv.setUint32(4 + i * 8, k.length, true);
    dv.setUint32(8 + i * 8, v.length, true);
    out.set(k, at); at += k.length + 1;
    out.set(v, at); at += v.length + 1;
  });
  return out;
}

const env = {
  proxy_log: (level, p, l) => { console.error(`log ${level}: ${str(p, l)}`); return 0; },
  proxy_get_current_time_nanoseconds: (p) => { clock += 1_000n; view().setBigUint64(p, clock, true); return 0; },
  proxy_set_tick_period_milliseconds: () => 0,
  proxy_get_buffer_bytes: (type, start, max, pp, sp) => {
    const b = type === 7 ? config : requestBody;
    give(b.subarray(start, start + max), pp, sp);
    return 0;
  },
  proxy_set_buffer_bytes: () => 0,
  proxy_get_header_map_pairs: (type, pp, sp) => { give(headers, pp, sp); return 0; },
  // One header: the answer's status (the filter reads it for passive health).
  proxy_get_header_map_value: (type, kp, kl, pp, sp) => { give(enc.encode('200'), pp, sp); return 0; },
  proxy_replace_header_map_value: () => 0,
  proxy_add_header_map_value: () => 0,
  proxy_remove_header_map_value: () => 0,
  proxy_get_property: (p, l, pp, sp) => { give(enc.encode('127.0.0.1:40000'), pp, sp); return 0; },
  proxy_get_shared_data: (kp, kl, pp, sp, cp) => {
    const e = shared.get(str(kp, kl));
    if (!e) return 1;
    give(e.value, pp, sp);
    view().setUint32(cp, e.cas, true);
    return 0;
  },
  proxy_set_shared_data: (kp, kl, vp, vl, c) => {
    const k = str(kp, kl);
    const e = shared.get(k);
    if (c && e && e.cas !== c) return 8;
    shared.set(k, { value: mem().slice(vp, vp + vl), cas: cas++ });
    return 0;
  },
  proxy_send_local_response: (status) => { if (status !== 204) console.error(`local reply ${status}`); return 0; },
  proxy_define_metric: (t, p, l, idp) => { metricNames.push(str(p, l)); view().setUint32(idp, metricNames.length, true); return 0; },
  proxy_increment_metric: (id, by) => { const k = metricNames[id - 1]; counters.set(k, (counters.get(k) || 0n) + by); return 0; },
  proxy_record_metric: () => 0,
  // Held requests (`hold`, off in this configuration): released on a tick through these.
  proxy_set_effective_context: () => 0,
  proxy_continue_stream: () => 0,
};

const wasi = new WASI({ version: 'preview1', args: [], env: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(wasmPath));
const wasiImports = wasi.getImportObject();
// The filter's clock is WASI's monotonic one (Envoy's steady clock): the same counted clock as
// proxy_get_current_time_nanoseconds, so runs count the same instructions.
const preview1 = { ...wasiImports.wasi_snapshot_preview1 };
const realClock = preview1.clock_time_get;
preview1.clock_time_get = (id, precision, p) => {
  if (id !== 1) return realClock(id, precision, p);
  clock += 1_000n; view().setBigUint64(p, clock, true); return 0;
};
inst = await WebAssembly.instantiate(module, { env, ...wasiImports, wasi_snapshot_preview1: preview1 });
wasi.initialize(inst);
const x = inst.exports;

function configure(ctx, json) {
  config = enc.encode(JSON.stringify(json));
  x.proxy_on_context_create(ctx, 0);
  x.proxy_on_vm_start(ctx, 0);
  if (!x.proxy_on_configure(ctx, config.length)) throw new Error('configuration refused');
}
configure(1, { pools: [], ingest: { token: 'profile-token' } });
// GPUROUTE_PROFILE_CONFIG: more of the filter's configuration (JSON), e.g. a weighted split.
const more = process.env.GPUROUTE_PROFILE_CONFIG ? JSON.parse(process.env.GPUROUTE_PROFILE_CONFIG) : {};
configure(2, { pools: [{ name: 'llama', models: ['llama-3-8b'] }], ...more });

// The snapshot, through the ingest root as sidecar-metrics would push it.
const nowMs = Number(clock / 1_000_000n);
const pods = Array.from({ length: 8 }, (_, i) => ({
  address: `127.0.0.1:${9000 + i}`, healthy: true, last_scrape_ms: nowMs, engine: 'vllm',
  waiting: 0, running: 4, kv_cache_usage: 0.3,
}));
// GPUROUTE_PROFILE_PODS=N: the pool padded to N pods with unhealthy ones (never picked), for
// what a large pool costs a request past scoring.
for (let i = pods.length; i < Number(process.env.GPUROUTE_PROFILE_PODS || 0); i++) {
  pods.push({ address: `10.${(i >> 16) & 255}.${(i >> 8) & 255}.${i & 255}:8000`, healthy: false,
    last_scrape_ms: nowMs, engine: 'vllm' });
}
requestBody = enc.encode(JSON.stringify({
  schema: 1, version: 1, source: 'profile', generated_at_ms: nowMs, pools: [{ name: 'llama', pods }],
}));
headers = headerMap([[':method', 'POST'], [':path', '/gpuroute/v1/snapshot'],
  ['authorization', 'Bearer profile-token'], ['content-length', String(requestBody.length)]]);
x.proxy_on_context_create(3, 1);
x.proxy_on_request_headers(3, 4, 0);
x.proxy_on_request_body(3, requestBody.length, 1);
x.proxy_on_delete(3);

// The requests.
headers = headerMap([[':method', 'POST'], [':path', reqPath],
  [':authority', '127.0.0.1:10000'], ['content-type', 'application/json'],
  ['content-length', String(body.length)], ['user-agent', 'profile'],
  ['x-request-id', 'b7f0c5a2-1c1e-4d8e-9d3f-2a7c5b9e0f11']]);
requestBody = body;
const t0 = process.hrtime.bigint();
for (let i = 0, ctx = 10; i < Number(n); i++, ctx++) {
  x.proxy_on_context_create(ctx, 2);
  x.proxy_on_request_headers(ctx, 7, 0);
  x.proxy_on_request_body(ctx, body.length, 1);
  if (x.proxy_on_response_headers) x.proxy_on_response_headers(ctx, 3, 0);
  if (x.proxy_on_response_body) x.proxy_on_response_body(ctx, 100, 1);
  x.proxy_on_delete(ctx);
  if (i % 1000 === 999) x.proxy_on_tick(2);
}
const ns = Number(process.hrtime.bigint() - t0) / Number(n);
x.proxy_on_tick(2);
console.log(`${n} requests, ${(ns / 1000).toFixed(2)} us each (filter code plus this JavaScript host)`);
// Every request must have been picked (a fail-open or an error would profile another path).
for (const [k, v] of counters) console.log(`  ${k} ${v}`);
if (counters.get('gpuroute.pool.llama.requests.picked') !== BigInt(n)) {
  console.error('not every request was picked: the profile is not the routing path');
  process.exitCode = 1;
}
