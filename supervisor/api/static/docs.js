// The API's interactive docs (/docs): the vendored Swagger UI on the daemon's schema. Its
// requests are same-origin, so the status page's session cookie (or nothing, on a daemon
// without a token) authorises them, as it does the page's own.
"use strict";
window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
});
