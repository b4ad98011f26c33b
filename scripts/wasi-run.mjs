// Runs a wasm32-wasip1 binary (a cargo test harness) under Node's WASI implementation, so the
// core crate's tests execute as WebAssembly, like the filter does in Envoy, with nothing beyond
// the Node.js the machine already has. Used as CARGO_TARGET_WASM32_WASIP1_RUNNER.
import { readFile } from 'node:fs/promises';
import { WASI } from 'node:wasi';
import process from 'node:process';

const [wasmPath, ...args] = process.argv.slice(2);
const wasi = new WASI({
  version: 'preview1',
  args: [wasmPath, ...args],
  env: process.env,
  preopens: { '/': '/' },
  returnOnExit: true,
});
const module = await WebAssembly.compile(await readFile(wasmPath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
process.exitCode = wasi.start(instance);
