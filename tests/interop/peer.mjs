// A compatible psymesh peer in JavaScript (js-libp2p 3), written from docs/protocol.md, for
// tests/test_interop_js.py. It joins a real daemon from an invite string and prints one JSON line per
// step: {"step", "ok", ...what it saw}. It checks the wire (the daemon's bytes and signatures), not
// psymesh's Python, which it never reads.
//
//   node peer.mjs <docs/protocol.md> <invite string> <letters: comma-separated names of LETTERS below>
import './node20.mjs'
import { readFileSync } from 'node:fs'
import { createLibp2p } from 'libp2p'
import { tcp } from '@libp2p/tcp'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { generateKeyPairFromSeed, publicKeyFromRaw } from '@libp2p/crypto/keys'
import { peerIdFromPublicKey } from '@libp2p/peer-id'
import { multiaddr } from '@multiformats/multiaddr'
import { decode } from '@msgpack/msgpack'
import { ed25519 } from '@noble/curves/ed25519.js'
import { sha256 } from '@noble/hashes/sha2.js'
import { bytesToHex, bytesToNumberLE, hexToBytes } from '@noble/curves/utils.js'
import { F64, cat, compareBytes, frame, le32, pack, pairingKeys, passwordScalar, spakeFinish, spakeStart, utf8, withoutNils } from './wire.mjs'

const PAIR = '/psymesh/pair/1.0.0'
const SESSION = '/psymesh/session/1.0.0'
const PAIR_MAX = 8192 // §2: the pairing protocol's frame limit
const SESSION_MAX = 4 * 1024 * 1024
const STEP_MS = 20000

// The letters this peer can send (§5.7), by name; the Python test knows the same bodies.
const LETTERS = {
  // A float that is not whole: float64 in every msgpack library.
  float: { text: 'a float in the body', body: { ratio: 2.5, nested: { z: -0.125, a: 'x', list: [1, 0.5, null] } } },
  // What a non-Python encoder writes (issue 34 item 1): a whole float as float64, integers past 2^53,
  // maps whose keys were built in another order.
  whole: {
    text: 'whole floats and big integers',
    body: { whole: new F64(2), zero: new F64(0), big: 18446744073709551615n, small: -9223372036854775808n, m: { b: 1, a: 2 } }
  }
}

const out = (step, ok, extra = {}) => process.stdout.write(JSON.stringify({ step, ok, ...extra }) + '\n')
const within = (ms, promise, what) => Promise.race([promise, new Promise((_, no) =>
  setTimeout(() => no(new Error(`no answer to ${what} within ${ms} ms`)), ms).unref())])

/** Length-prefixed msgpack frames (§2) over a js-libp2p stream. Reads by the stream's events and
 *  state, not its async iterator: when the far end half-closed while multistream-select still held its
 *  bytes, js-libp2p 3.3 never ends an iterator (nor emits `end`) for it. */
class Framed {
  constructor (stream, max) {
    this.stream = stream
    this.max = max
    this.buffer = new Uint8Array(0)
    this.ended = stream.readStatus === 'closed'
    this.error = null
    this.wake = null
    const poke = () => { this.wake?.(); this.wake = null }
    stream.addEventListener('end', () => { this.ended = true; poke() })
    stream.addEventListener('close', (evt) => { this.ended = true; this.error = evt.error ?? null; poke() })
    stream.addEventListener('message', (evt) => {
      this.buffer = cat(this.buffer, evt.data.subarray ? evt.data.subarray() : evt.data); poke()
    })
  }

  send (message) { this.stream.send(frame(message)) }

  /** The next message, or null when the stream ended on a frame boundary. */
  async receive () {
    for (;;) {
      if (this.buffer.length >= 4) {
        const length = new DataView(this.buffer.buffer, this.buffer.byteOffset).getUint32(0)
        if (length > this.max) throw new Error(`frame of ${length} bytes over ${this.max}`)
        if (this.buffer.length >= 4 + length) {
          const body = this.buffer.slice(4, 4 + length)
          this.buffer = this.buffer.slice(4 + length)
          return decode(body, { useBigInt64: true })
        }
      }
      // the far end's half-close may have come before any listener (then no `end` event follows)
      if (this.stream.remoteWriteStatus === 'closed' && this.stream.readBufferLength === 0) this.ended = true
      if (this.ended) {
        if (this.error) throw this.error
        if (this.buffer.length) throw new Error('stream ended inside a frame')
        return null
      }
      await new Promise(resolve => { this.wake = resolve })
    }
  }
}

/** The client side of a session (§5.1): strictly increasing rids, frames until `end: true`. */
class Session {
  constructor (stream) { this.framed = new Framed(stream, SESSION_MAX); this.rid = 0 }

  /** Send one request; return every frame answering it (the last has `end: true`). */
  async request (message) {
    const rid = ++this.rid
    this.framed.send({ ...message, v: 1, rid })
    const frames = []
    for (;;) {
      const reply = await within(STEP_MS, this.framed.receive(), message.type)
      if (reply === null) throw new Error(`session ended before the answer to ${message.type}`)
      if (reply.rid !== rid) throw new Error(`answer for rid ${reply.rid}, asked ${rid}: ${JSON.stringify(reply)}`)
      frames.push(reply)
      if (reply.end === true) return frames
    }
  }
}

// ---------------------------------------------------------------------------- the words (Appendix A)

/** Appendix A's two lists, read from the document itself and checked against its SHA-256s. */
function wordLists (doc) {
  const appendix = doc.slice(doc.indexOf('## Appendix A'))
  const blocks = [...appendix.matchAll(/```\n([\s\S]*?)```/g)].map(m => m[1])
  const lists = blocks.slice(0, 2).map(block => block.trim().split('\n').flatMap(line => line.trim().split(/\s+/).slice(1)))
  const digests = [...appendix.matchAll(/`([0-9a-f]{64})`/g)].map(m => m[1])
  lists.forEach((list, i) => {
    if (list.length !== 256 || bytesToHex(sha256(utf8.encode(list.join('\n')))) !== digests[i]) {
      throw new Error(`Appendix A list ${i} does not match its SHA-256`)
    }
  })
  return lists
}

// ---------------------------------------------------------------------------- invites (§5.2)

function base32Decode (text) {
  const alphabet = 'abcdefghijklmnopqrstuvwxyz234567'
  let bits = 0; let value = 0; const bytes = []
  for (const ch of text.toLowerCase()) {
    const i = alphabet.indexOf(ch)
    if (i < 0) throw new Error(`not base32: ${ch}`)
    value = (value << 5) | i; bits += 5
    if (bits >= 8) { bytes.push((value >> (bits - 8)) & 0xff); bits -= 8 }
  }
  return Uint8Array.from(bytes)
}

function readInvite (text) {
  if (!text.startsWith('psymesh1:')) throw new Error('not an invite string')
  const raw = base32Decode(text.slice('psymesh1:'.length))
  const invite = decode(raw)
  if (compareBytes(pack(invite), raw) !== 0) throw new Error('the invite is not canonical msgpack')
  return { addrs: invite.a, nameplate: invite.c[0], secret: invite.c[1], key: invite.k }
}

// ---------------------------------------------------------------------------- signatures (§3)

const signedBytes = (context, fields) => cat(utf8.encode(context), Uint8Array.of(0), pack(fields, true))
const verify = (signature, context, fields, publicKey) => ed25519.verify(signature, signedBytes(context, fields), publicKey)

/** A manifest's signed fields (§5.3): nil fields left out, in it and in its capabilities and limits. */
function manifestFields (manifest) {
  const { signature, ...rest } = manifest
  const fields = withoutNils(rest)
  fields.capabilities = fields.capabilities.map(withoutNils)
  fields.limits = withoutNils(fields.limits ?? {})
  return fields
}

// ---------------------------------------------------------------------------- the steps

/** The document's worked examples (§3, §5.2, §5.7), computed here: they hold for this code too. */
async function examples () {
  const hex = bytesToHex
  const canonical = hex(pack({ b: 1, a: [{ y: 2, x: 3 }], n: -1, big: 300, s: Uint8Array.of(1) }))
  const pw = '4817-chisel-molecule'
  const spake = spakeStart(pw, bytesToNumberLE(hexToBytes('4fe2a684e0e6c5e370ca0d89f5e2cb0da1e2ecd4028fa2d395fbca4e33f25805')))
  const K = spakeFinish(spake, hexToBytes('427925f481313ebe8671ffe315289b3e06602498570b11db7e87128a6d8dc035b9'), 'J', 'I')
  const seed = Uint8Array.from({ length: 32 }, (_, i) => i)
  const letter = {
    id: 'l1', sender: '12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB', recipient: '12D3KooWCd3eX8r5ihRvzK7P1yPq5aakaBJhG5GNj18YTztPhoCa',
    thread: 'main', tseq: 1, kind: 'send', text: 'hi', body: {}, at: 1800000000000, withdrawn: false
  }
  const checks = {
    canonical: canonical === '85a1619182a17803a17902a16201a3626967cd012ca16effa173c40101',
    spake_w: hex(le32(passwordScalar(pw))) === 'b72008d56c6fb2f5d95a3e7066abd62bce555a41226b3c8a0e1976195ae2360f',
    spake_X: hex(spake.message) === '415e1e09bfe73c52511a755d94cb0f03d0cf80abf9af6466ecea60b2e1157bdf10',
    spake_K: hex(K) === '055bbbdc4a2550576b9968f78d5ef50082e17c370657f8f08a01064f4101f7cd',
    peer_id: peerIdFromPublicKey((await generateKeyPairFromSeed('Ed25519', seed)).publicKey).toString() === letter.sender,
    letter_bytes: signedBytes('psymesh/letter/v1', letter).length === 215,
    letter_signature: hex(ed25519.sign(signedBytes('psymesh/letter/v1', letter), seed)) ===
      '6b1b95b8c2a3f62a87f5921352042d4b2b5fd70ca07bf9768006dbcdf05e7e69f98ff94804772454768a011dee054759a8f0c8c5461c80966bef59cf86b8f008'
  }
  out('examples', Object.values(checks).every(Boolean), checks)
}

async function expectStranger (node, target) {
  // §6: a stranger's session stream gets one `error unknown_peer` without `rid`, then the stream closes.
  const stream = await node.dialProtocol(target, SESSION)
  const framed = new Framed(stream, SESSION_MAX)
  framed.send({ type: 'ping', v: 1, rid: 1, seq: 1, payload: Uint8Array.of(1) })
  const refusal = await within(STEP_MS, framed.receive(), 'the stranger\'s session')
  const after = await within(STEP_MS, framed.receive().catch(() => null), 'the close')
  // §6: libp2p's own identify is refused to strangers too (multistream `na`).
  let identify = 'served'
  try { await node.dialProtocol(target, '/ipfs/id/1.0.0') } catch (e) { identify = e.name }
  out('stranger', refusal?.type === 'error' && refusal.code === 'unknown_peer' && !('rid' in refusal) && after === null &&
    identify === 'UnsupportedProtocolError', { refusal, closed: after === null, identify })
}

async function pair (node, target, invite, lists, J, I) {
  const code = `${invite.nameplate}-${lists[0][invite.secret[0]]}-${lists[1][invite.secret[1]]}`
  const stream = await node.dialProtocol(target, PAIR)
  const framed = new Framed(stream, PAIR_MAX)
  const spake = spakeStart(code)
  framed.send({ type: 'pair.hello', v: 1, nameplate: invite.nameplate, pake: spake.message })
  const pake = await within(STEP_MS, framed.receive(), 'pair.hello')
  if (pake?.type !== 'pair.pake') throw new Error(`pair.hello answered ${JSON.stringify(pake)}`)
  const K = spakeFinish(spake, pake.pake, J, I)
  const keys = pairingKeys(K, invite.nameplate, J, I, spake.message, pake.pake)
  const info = { name: 'js-peer', role: 'node', addrs: [] }
  framed.send({ type: 'pair.confirm', v: 1, mac: keys.macJ, info })
  const welcome = await within(STEP_MS, framed.receive(), 'pair.confirm')
  if (welcome?.type !== 'pair.welcome') throw new Error(`pair.confirm answered ${JSON.stringify(welcome)}`)
  const m = welcome.manifest
  const macOk = compareBytes(welcome.mac, keys.macI) === 0
  const grantOk = m.issuer === I && m.subject === J && verify(m.signature, 'psymesh/manifest/v1', manifestFields(m), invite.key)
  const words = [...keys.words].map((b, i) => lists[i % 2][b]).join(' ')
  out('pair', macOk && grantOk, {
    code, mac_ok: macOk, grant_ok: grantOk, inviter: welcome.info?.name, words, capabilities: m.capabilities.map(c => c.name)
  })
  return m
}

async function ping (session) {
  const payload = crypto.getRandomValues(new Uint8Array(16))
  const [pong] = await session.request({ type: 'ping', seq: 7, payload })
  out('ping', pong.type === 'pong' && pong.seq === 7 && compareBytes(pong.payload, payload) === 0, { pong: { ...pong, payload: bytesToHex(pong.payload) } })
}

async function task (session) {
  const id = `js-${bytesToHex(crypto.getRandomValues(new Uint8Array(6)))}`
  const frames = await session.request({ type: 'task.submit', spec: { id, kind: 'tool', tool: 'system.info', args: {} }, follow: true })
  const [accepted, ...events] = frames
  const last = events.at(-1)
  const seqsOk = events.every((e, i) => e.type === 'task.event' && e.task_id === id && e.seq === i + 1)
  const [status] = await session.request({ type: 'task.ack', task_id: id, upto_seq: last.seq })
  const ok = accepted.type === 'task.accepted' && accepted.status.state === 'submitted' && accepted.created === true &&
    seqsOk && events[0].kind === 'accepted' && last.kind === 'result' && last.state === 'completed' &&
    status.type === 'task.status' && status.acked_seq === last.seq
  out('task', ok, { task_id: id, kinds: events.map(e => e.kind), state: last.state, acked_seq: status.acked_seq, result_keys: Object.keys(last.data?.result ?? {}) })
}

async function letter (session, name, tseq, J, I, seed, inviterKey) {
  const { text, body } = LETTERS[name]
  const fields = { id: `js-${name}-${Date.now()}`, sender: J, recipient: I, thread: 'interop', tseq, kind: 'send', text, body, at: Date.now(), withdrawn: false }
  const signature = ed25519.sign(signedBytes('psymesh/letter/v1', fields), seed)
  const [reply] = await session.request({ type: 'msg.send', letter: { ...fields, signature } })
  let proofOk = false
  if (reply.type === 'msg.receipt') {
    const { signature: proofSig, ...proof } = reply.proof
    proofOk = proof.recipient === I && proof.sender === J && proof.ids.length === 1 && proof.ids[0] === fields.id &&
      verify(proofSig, 'psymesh/receipt/v1', { at: proof.at, ids: proof.ids, recipient: proof.recipient, sender: proof.sender }, inviterKey)
  }
  out(`letter:${name}`, reply.type === 'msg.receipt' && reply.status === 'stored' && proofOk,
    { id: fields.id, reply: reply.type === 'msg.receipt' ? { status: reply.status, proof_ok: proofOk } : reply })
}

/** Serve the daemon's own session to us (§5 "Both sides serve"): take what it pushes, answer the rest. */
const served = []
function serve (node) {
  return node.handle(SESSION, async (stream) => {
    const framed = new Framed(stream, SESSION_MAX)
    try {
      for (let msg; (msg = await framed.receive()) !== null;) {
        served.push(msg.type)
        const answer = {
          'addrs.push': () => ({ type: 'addrs.ok' }),
          'manifest.push': () => ({ type: 'manifest.ok', serial: msg.manifest?.serial }),
          'mail.key': () => ({ type: 'mail.key_ok', serial: msg.key?.serial }),
          ping: () => ({ type: 'pong', seq: msg.seq, payload: msg.payload, time: new F64(Date.now() / 1000) })
        }[msg.type]?.() ?? { type: 'error', code: 'bad_request', message: `this peer does not serve ${msg.type}` }
        framed.send({ ...answer, v: 1, rid: msg.rid, end: true })
      }
    } catch { stream.abort(new Error('bad frame')) }
  })
}

async function main () {
  const [docPath, inviteText, letterNames = ''] = process.argv.slice(2)
  await examples()
  const lists = wordLists(readFileSync(docPath, 'utf8'))
  const invite = readInvite(inviteText)
  const seed = crypto.getRandomValues(new Uint8Array(32))
  const node = await createLibp2p({
    privateKey: await generateKeyPairFromSeed('Ed25519', seed),
    addresses: { listen: [] },
    transports: [tcp()],
    connectionEncrypters: [noise()],
    streamMuxers: [yamux()]
  })
  await serve(node)
  try {
    const J = node.peerId.toString()
    const I = peerIdFromPublicKey(publicKeyFromRaw(invite.key)).toString()
    const tcpAddr = invite.addrs.find(a => a.startsWith('/ip4/') && a.includes('/tcp/'))
    const target = multiaddr(tcpAddr.includes('/p2p/') ? tcpAddr : `${tcpAddr}/p2p/${I}`)
    const connection = await within(STEP_MS, node.dial(target), 'the dial')
    out('connect', connection.remotePeer.toString() === I, { noise_proved: connection.remotePeer.toString(), from_invite: I })
    await expectStranger(node, target)
    await pair(node, target, invite, lists, J, I)
    const session = new Session(await node.dialProtocol(target, SESSION))
    await ping(session)
    await task(session)
    let tseq = 0
    for (const name of letterNames.split(',').filter(Boolean)) await letter(session, name, ++tseq, J, I, seed, invite.key)
    out('done', true, { peer_id: J, served })
  } catch (e) {
    out('crashed', false, { error: String(e?.stack ?? e) })
  } finally {
    await node.stop()
  }
}

await main()
