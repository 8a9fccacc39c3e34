// Swagger UI over the node's own OpenAPI document (served from the swagger-ui-bundle package).
// Under a proxy's sub-path (`root_path`, on <html> as `data-root`) the document is there too.
const root = document.documentElement.dataset.root || "";
window.ui = SwaggerUIBundle({ url: `${root}/openapi.json`, dom_id: "#swagger-ui" });
