// js-libp2p 3 calls Promise.withResolvers (Node >= 22); Debian's Node 20 lacks it. Imported first by
// peer.mjs, before any libp2p module is evaluated.
Promise.withResolvers ??= function () {
  let resolve, reject
  const promise = new this((yes, no) => { resolve = yes; reject = no })
  return { promise, resolve, reject }
}
