// Preloaded (node --require) into an agent that runs on Node: every socket it opens to a host other than the
// loopback is refused, and the host is written to the file named by DUO_NODE_GUARD_LOG, one "host:port" a line.
// For the agents that send even 127.0.0.1's traffic through HTTP(S)_PROXY, where a proxy trap cannot be set.
'use strict';
const fs = require('node:fs');
const net = require('node:net');

const LOOPBACK = new Set([undefined, '', 'localhost', '127.0.0.1', '::1']);
const connect = net.Socket.prototype.connect;

net.Socket.prototype.connect = function guardedConnect(...args) {
  // net.connect passes its arguments normalized, as [options, callback]; a socket's own connect takes them as given.
  const first = Array.isArray(args[0]) ? args[0][0] : args[0];
  const options = typeof first === 'object' && first !== null ? first : { port: first, host: args[1] };
  if (options.path === undefined && !LOOPBACK.has(options.host)) {
    fs.appendFileSync(process.env.DUO_NODE_GUARD_LOG, `${options.host}:${options.port}\n`);
    process.nextTick(() => this.destroy(new Error(`refused by the test's guard: ${options.host} is not 127.0.0.1`)));
    return this;
  }
  return connect.apply(this, args);
};
