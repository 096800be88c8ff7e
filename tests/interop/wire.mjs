// The psymesh wire as docs/protocol.md defines it, for the interop peer (peer.mjs): canonical msgpack
// (§3), frames (§2), SPAKE2 and the pairing key schedule (§5.2). Nothing here is read from psymesh's code.
import { ed25519 } from '@noble/curves/ed25519.js'
import { hkdf } from '@noble/hashes/hkdf.js'
import { hmac } from '@noble/hashes/hmac.js'
import { sha256 } from '@noble/hashes/sha2.js'
import { bytesToNumberBE, bytesToNumberLE, numberToBytesLE } from '@noble/curves/utils.js'

const utf8 = new TextEncoder()

/** A number the encoder writes as float64 (`cb`) even when it is whole, as Python's `2.0` is. */
export class F64 {
  constructor (value) { this.value = value }
}

const cat = (...parts) => {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let at = 0
  for (const p of parts) { out.set(p, at); at += p.length }
  return out
}

const be = (n, bytes) => {
  const out = new Uint8Array(bytes)
  let v = BigInt(n)
  for (let i = bytes - 1; i >= 0; i--) { out[i] = Number(v & 0xffn); v >>= 8n }
  return out
}

function encInt (n) {
  n = BigInt(n)
  if (n >= 0n) {
    if (n < 128n) return Uint8Array.of(Number(n))
    if (n < 256n) return cat([0xcc], be(n, 1))
    if (n < 65536n) return cat([0xcd], be(n, 2))
    if (n < 4294967296n) return cat([0xce], be(n, 4))
    if (n < 18446744073709551616n) return cat([0xcf], be(n, 8))
    throw new Error('integer too large for msgpack')
  }
  if (n >= -32n) return Uint8Array.of(Number(n & 0xffn))
  const two = (bits) => be(n + (1n << BigInt(bits)), bits / 8)
  if (n >= -128n) return cat([0xd0], two(8))
  if (n >= -32768n) return cat([0xd1], two(16))
  if (n >= -2147483648n) return cat([0xd2], two(32))
  if (n >= -9223372036854775808n) return cat([0xd3], two(64))
  throw new Error('integer too small for msgpack')
}

function encLen (n, fix, fixMax, codes) {
  if (fix !== null && n <= fixMax) return Uint8Array.of(fix | n)
  if (codes[0] !== null && n < 256) return cat([codes[0]], be(n, 1))
  if (n < 65536) return cat([codes[1]], be(n, 2))
  return cat([codes[2]], be(n, 4))
}

const compareBytes = (a, b) => {
  for (let i = 0; i < Math.min(a.length, b.length); i++) if (a[i] !== b[i]) return a[i] - b[i]
  return a.length - b.length
}

/** Canonical msgpack (§3): keys sorted by their UTF-8 bytes at every depth, shortest forms,
 *  floats as float64, byte strings as bin. `undefined` fields are left out of maps. `signing`:
 *  the signed bytes (§3), where a number is written by its value: a whole one (a float64 `2.0`
 *  too) as the shortest integer, any other as float64. */
export function pack (value, signing = false) {
  if (value === null) return Uint8Array.of(0xc0)
  if (value === false) return Uint8Array.of(0xc2)
  if (value === true) return Uint8Array.of(0xc3)
  if (value instanceof F64) {
    const v = value.value
    if (signing && Number.isInteger(v) && v >= -(2 ** 63) && v < 2 ** 64) return encInt(BigInt(v))
    const out = new Uint8Array(9); out[0] = 0xcb
    new DataView(out.buffer).setFloat64(1, value.value); return out
  }
  if (typeof value === 'bigint') return encInt(value)
  if (typeof value === 'number') return Number.isInteger(value) ? encInt(value) : pack(new F64(value), signing)
  if (typeof value === 'string') {
    const b = utf8.encode(value)
    return cat(encLen(b.length, 0xa0, 31, [0xd9, 0xda, 0xdb]), b)
  }
  if (value instanceof Uint8Array) return cat(encLen(value.length, null, 0, [0xc4, 0xc5, 0xc6]), value)
  if (Array.isArray(value)) return cat(encLen(value.length, 0x90, 15, [null, 0xdc, 0xdd]), ...value.map((v) => pack(v, signing)))
  if (value instanceof Map || typeof value === 'object') {
    const entries = (value instanceof Map ? [...value.entries()] : Object.entries(value))
      .filter(([, v]) => v !== undefined)
      .map(([k, v]) => [utf8.encode(k), k, v])
      .sort((a, b) => compareBytes(a[0], b[0]))
    return cat(encLen(entries.length, 0x80, 15, [null, 0xde, 0xdf]), ...entries.flatMap(([, k, v]) => [pack(k), pack(v, signing)]))
  }
  throw new Error(`cannot encode ${typeof value}`)
}

/** One frame (§2): 4-byte big-endian length, then the msgpack body. */
export const frame = (message) => { const body = pack(message); return cat(be(body.length, 4), body) }

/** Drop nil fields of a decoded object (the top level of a signed object, §3). */
export const withoutNils = (obj) => Object.fromEntries(Object.entries(obj).filter(([, v]) => v !== null && v !== undefined))

// ---------------------------------------------------------------------------- SPAKE2 (§5.2)

const Point = ed25519.Point
const L = Point.Fn.ORDER
const M = Point.fromHex('15cfd18e385952982b6a8f8c7854963b58e34388c8e6dae891db756481a02312')
const N = Point.fromHex('f04f2e7eb734b2a8f8b472eaf9c3c632576ac64aea650b496a8a20ff00e583c3')

export const passwordScalar = (pw) =>
  bytesToNumberBE(hkdf(sha256, utf8.encode(pw), new Uint8Array(0), utf8.encode('SPAKE2 pw'), 48)) % L

const mul = (point, k) => (k % L === 0n ? Point.ZERO : point.multiply(k % L))

/** Side A (the joiner). `x` may be given (tests of the worked example), else it is drawn. */
export function spakeStart (pw, x) {
  const w = passwordScalar(pw)
  x ??= bytesToNumberLE(crypto.getRandomValues(new Uint8Array(64))) % L  // 512 bits: no visible bias mod L
  const Xstar = mul(Point.BASE, x).add(mul(M, w)).toBytes()
  return { w, x, pw, message: cat([0x41], Xstar) }
}

export function spakeFinish (state, theirs, idA, idB) {
  if (theirs.length !== 33 || theirs[0] !== 0x42) throw new Error('pake: not side B')
  const Ystar = theirs.slice(1)
  const Y = Point.fromBytes(Ystar)
  if (Y.is0() || !Y.isTorsionFree()) throw new Error('pake: not in the prime-order subgroup')
  const Xstar = state.message.slice(1)
  if (compareBytes(Xstar, Ystar) === 0) throw new Error('pake: reflected')
  const KA = mul(Y.subtract(mul(N, state.w)), state.x).toBytes()
  return sha256(cat(sha256(utf8.encode(state.pw)), sha256(utf8.encode(idA)), sha256(utf8.encode(idB)), Xstar, Ystar, KA))
}

/** The pairing key schedule (§5.2): the two MACs and the verification words' bytes. */
export function pairingKeys (K, nameplate, J, I, X, Y) {
  const T = sha256(pack(['/psymesh/pair/1.0.0', nameplate, J, I, X, Y]))
  const okm = hkdf(sha256, K, T, utf8.encode('psymesh/pair/v1'), 128)
  const [kJ, kI, , words] = [0, 1, 2, 3].map(i => okm.slice(32 * i, 32 * i + 32))
  return {
    macJ: hmac(sha256, kJ, cat(utf8.encode('joiner'), T)),
    macI: hmac(sha256, kI, cat(utf8.encode('inviter'), T)),
    words: words.slice(0, 4)
  }
}

export const le32 = (n) => numberToBytesLE(n, 32)
export { cat, compareBytes, utf8 }
