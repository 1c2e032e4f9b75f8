// bench/router.py's floor of an endpoint picker: an ext_proc server that answers every
// ProcessingRequest with one fixed ProcessingResponse, with no routing and no Python: Node's
// built-in http2 module (nghttp2, compiled) on one event loop, one wake-up per message. What any
// picker behind the same Envoy costs at least on this machine.
//
//   node bench/_ext_proc_floor.js PORT RESPONSE_HEX   prints "serving" once listening on 127.0.0.1:PORT
//
// gRPC over HTTP/2 as the gRPC project's PROTOCOL-HTTP2.md defines it: each message is a 1-byte
// compressed flag (0) and a 4-byte big-endian length before the bytes; the stream ends with
// trailers carrying grpc-status.
'use strict';
const http2 = require('http2');

const [port, responseHex] = process.argv.slice(2);
const response = Buffer.from(responseHex, 'hex');
const frame = Buffer.alloc(5 + response.length);
frame.writeUInt32BE(response.length, 1);
response.copy(frame, 5);

const server = http2.createServer();
server.on('stream', (stream) => {
  stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { waitForTrailers: true });
  stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
  let pending = Buffer.alloc(0);
  stream.on('data', (chunk) => {
    pending = Buffer.concat([pending, chunk]);
    while (pending.length >= 5 && pending.length >= 5 + pending.readUInt32BE(1)) {
      pending = pending.subarray(5 + pending.readUInt32BE(1));
      stream.write(frame);  // one answer per message
    }
  });
  stream.on('end', () => stream.end());
  stream.on('error', () => {});  // Envoy resets the stream when the HTTP call ends
});
server.listen(Number(port), '127.0.0.1', () => console.log('serving'));
